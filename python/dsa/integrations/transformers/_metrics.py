"""Indexer recall@k, for logging: how much of the attention the indexer's selection keeps.

For a query row with more visible compressed entries than the indexer's k, let
``p`` be the attention over the row's visible compressed entries (each head's own
softmax, averaged over heads). recall@k = ``p``'s mass on the entries the indexer
selected / ``p``'s mass on its own top k, so 1 means the indexer picked the k
entries the attention weighs most. Rows with at most k visible entries are left
out (any selection of all of them is perfect). Computed without gradient on up to
``max_rows`` evenly spaced rows per call: a few [rows, heads, entries] products.
"""
from __future__ import annotations

from typing import Optional

import torch


def _segments(geom, ratio: int):
    """(batch row or None, query rows, query count, key count, compressed rows) per sequence."""
    if geom.layout == "BSND":
        for b in range(geom.batch):
            ql, kl = geom.query_lengths[b], geom.key_lengths[b]
            yield b, slice(0, ql), ql, kl, slice(0, kl // ratio)
        return
    q0 = k0 = c0 = 0
    for q_end, k_end in zip(geom.query_lengths, geom.key_lengths):
        ql, kl = q_end - q0, k_end - k0
        yield None, slice(q0, q_end), ql, kl, slice(c0, c0 + kl // ratio)
        q0, k0, c0 = q_end, k_end, c0 + kl // ratio


@torch.no_grad()
def recall_at_k(q: torch.Tensor, cmp_kv: torch.Tensor, cmp_idx: torch.Tensor, scale: float, ratio: int, geom,
                max_rows: int = 256) -> Optional[float]:
    values = recall_values(q, cmp_kv, cmp_idx, scale, ratio, geom, max_rows)
    return None if values is None else float(values.mean())


@torch.no_grad()
def recall_values(q: torch.Tensor, cmp_kv: torch.Tensor, cmp_idx: torch.Tensor, scale: float, ratio: int, geom,
                  max_rows: int = 256) -> Optional[torch.Tensor]:
    """recall@k of each sampled row (None where no row has more visible entries than k):
    what ``recall_at_k`` averages, for callers that pool several calls' rows."""
    k = cmp_idx.shape[-1]
    values = []
    for b, rows, ql, kl, crows in _segments(geom, ratio):
        qs = q[b] if b is not None else q
        cs = cmp_kv[b] if b is not None else cmp_kv
        idx = cmp_idx[b] if b is not None else cmp_idx
        qs, cs, idx = qs[rows], cs[crows], idx[rows]
        visible = (kl - ql + 1 + torch.arange(ql)) // ratio  # bottom-right aligned positions
        candidates = torch.nonzero(visible > k).flatten()
        if candidates.numel() == 0:
            continue
        take = candidates[torch.linspace(0, candidates.numel() - 1, min(max_rows, candidates.numel())).long()]
        logits = torch.einsum("nhd,cd->nhc", qs[take].float(), cs.float()) * scale
        hidden = torch.arange(cs.shape[0])[None, :] >= visible[take][:, None]
        p = logits.masked_fill(hidden[:, None, :], float("-inf")).softmax(-1).mean(1)
        best = p.topk(k, dim=-1).values.sum(-1)
        sel = idx[take].long()
        valid = (sel >= 0) & (sel < visible[take][:, None])
        picked = (p.gather(1, sel.clamp(min=0)) * valid).sum(-1)
        values.append(picked / best)
    if not values:
        return None
    return torch.cat(values)
