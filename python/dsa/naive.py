"""Naive PyTorch implementations of the dsa ops, written from spec/ops.md.

Each ``naive_<op>`` composes plain torch ops the way an unfused model would run
them, in the dtype of its inputs. Evaluated on float64 inputs it is the
independent oracle of the Python tests; in the working dtype it is the
"naive PyTorch" peer of the benchmarks (it materialises the full score tensors,
which is exactly what the fused kernels avoid).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def _cu(ends: Optional[Sequence[int]], total: int) -> list[int]:
    """TND cumulative ends without a leading 0 (None: one sequence) -> cu_seqlens."""
    if ends is None:
        return [0, total]
    if isinstance(ends, torch.Tensor):
        ends = ends.tolist()
    return [0] + [int(e) for e in ends]


def naive_indexer(index_query: torch.Tensor, index_key: torch.Tensor, weights: torch.Tensor, *,
                  topk: int, scale: float = 1.0, cmp_ratio: int = 1,
                  query_lengths=None, key_lengths=None, return_scores: bool = False):
    """Lightning indexer + top-k (ops.md 4.1), TND layout, in the inputs' dtype.

    ``I[t, s] = scale * sum_j weights[t, j] * relu(q[t, j] . k[s])`` over the visible
    keys (bottom-right causal; compressed entries when ``cmp_ratio > 1``), then
    ``torch.topk`` and the selected positions sorted ascending, ``-1`` padded.
    Ties are broken however ``torch.topk`` breaks them.
    """
    if index_key.dim() == 3:
        index_key = index_key.squeeze(1)
    T, S = index_query.shape[0], index_key.shape[0]
    q_cu = _cu(query_lengths, T)
    # key_lengths speak of raw keys; compressed sequences hold Lk // m entries each.
    # Compressed keys without key_lengths: the raw keys are the queries' own tokens.
    k_cu = _cu(key_lengths, S) if key_lengths is not None or cmp_ratio == 1 else q_cu
    indices = torch.full((T, topk), -1, dtype=torch.int32)
    scores = torch.full((T, topk), float("-inf"), dtype=torch.float32)
    c_begin = 0
    for b in range(len(q_cu) - 1):
        q0, q1 = q_cu[b], q_cu[b + 1]
        lq, lk = q1 - q0, k_cu[b + 1] - k_cu[b]
        n_keys = lk // cmp_ratio if cmp_ratio > 1 else lk
        k0 = c_begin if cmp_ratio > 1 else k_cu[b]
        c_begin += n_keys
        if lq == 0:
            continue
        q, w, k = index_query[q0:q1], weights[q0:q1], index_key[k0:k0 + n_keys]
        # [Lq, Hi, n_keys] per-head logits: the O(T*Hi*S) tensor a fused kernel never builds.
        logits = torch.einsum("thd,sd->ths", q, k).relu_()
        score = (logits * w.unsqueeze(-1)).sum(dim=1) * scale          # [Lq, n_keys]
        del logits
        pos = (lk - lq) + torch.arange(lq)                              # bottom-right alignment
        n_visible = (pos + 1) // cmp_ratio if cmp_ratio > 1 else pos + 1
        visible = torch.arange(n_keys).unsqueeze(0) < n_visible.unsqueeze(1)
        score = score.masked_fill(~visible, float("-inf"))
        kk = min(topk, n_keys)
        if kk == 0:
            continue
        top_val, top_idx = torch.topk(score, kk, dim=-1)
        valid = torch.arange(kk).unsqueeze(0) < n_visible.clamp(max=kk).unsqueeze(1)
        # Ascending positions with -1 padding last: sort with invalid slots pushed to the end.
        key = torch.where(valid, top_idx, torch.full_like(top_idx, n_keys))
        key, order = torch.sort(key, dim=-1)
        top_val = torch.gather(top_val, -1, order).float()
        ok = key < n_keys
        indices[q0:q1, :kk] = torch.where(ok, key, -1).to(torch.int32)
        scores[q0:q1, :kk] = torch.where(ok, top_val, float("-inf"))
    return (indices, scores) if return_scores else indices
