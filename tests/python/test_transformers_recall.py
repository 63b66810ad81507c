"""Indexer recall@k of the transformers patch (dsa.integrations.transformers._metrics)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dsa.integrations.transformers._geometry import Geometry  # noqa: E402
from dsa.integrations.transformers._metrics import recall_at_k  # noqa: E402


def _brute(q, ckv, idx, scale, ratio, k):
    """Per row with more than k visible entries: mass on idx / mass on the top k (loops)."""
    T, H, _ = q.shape
    out = []
    for i in range(T):
        vis = (i + 1) // ratio
        if vis <= k:
            continue
        p = torch.zeros(vis, dtype=torch.float64)
        for h in range(H):
            p += torch.softmax((q[i, h].double() @ ckv[:vis].double().T) * scale, -1) / H
        best = p.sort(descending=True).values[:k].sum()
        picked = sum(p[j] for j in idx[i].tolist() if 0 <= j < vis)
        out.append(float(picked / best))
    return sum(out) / len(out)


def test_recall_matches_a_brute_force_count_and_is_one_for_the_attention_top_k():
    g = torch.Generator().manual_seed(0)
    T, H, D, ratio, k = 96, 3, 16, 4, 5
    q, ckv = torch.randn(T, H, D, generator=g), torch.randn(T // ratio, D, generator=g)
    geom = Geometry(layout="TND", batch=1, seq=T, past=0, query_lengths=[T], key_lengths=[T], doc_lengths=[T])
    # Random distinct visible picks (and -1 where fewer are visible).
    idx = torch.full((T, k), -1, dtype=torch.int32)
    for i in range(T):
        vis = (i + 1) // ratio
        idx[i, :min(k, vis)] = torch.randperm(vis, generator=g)[:min(k, vis)].int()
    got = recall_at_k(q, ckv, idx, 0.3, ratio, geom, max_rows=T)
    assert got == pytest.approx(_brute(q, ckv, idx, 0.3, ratio, k), rel=1e-5)
    assert 0.0 < got < 1.0
    # The attention's own top k scores 1.
    best = torch.full((T, k), -1, dtype=torch.int32)
    for i in range(T):
        vis = (i + 1) // ratio
        p = sum(torch.softmax((q[i, h] @ ckv[:vis].T) * 0.3, -1) for h in range(H)) if vis else None
        if vis:
            best[i, :min(k, vis)] = p.topk(min(k, vis)).indices.int()
    assert recall_at_k(q, ckv, best, 0.3, ratio, geom, max_rows=T) == pytest.approx(1.0, abs=1e-6)
    # No row sees more than k entries: nothing to measure.
    short = Geometry(layout="TND", batch=1, seq=16, past=0, query_lengths=[16], key_lengths=[16], doc_lengths=[16])
    assert recall_at_k(q[:16], ckv[:4], idx[:16], 0.3, ratio, short) is None
