"""Plain PyTorch sparse attention (docs/ops.md 4.2), written from the spec and nothing else.

* ``naive_sparse_attention`` computes in the inputs' dtype, composed of torch ops the way
  an unfused model runs it (gather, einsum, masked softmax with a sink column, einsum);
  autograd gives its backward. It is the "naive PyTorch peer" of the benchmarks.
* ``oracle_sparse_attention`` is the same in float64: the oracle of the Python tests.

Nothing here imports the compiled extension, so the oracle is independent of the code it
checks. Per sequence it builds ``[Lq, H, K]`` logits (``K`` = attended candidates), so it
is meant for test and benchmark sizes.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

Lengths = Optional[Union[Sequence[int], torch.Tensor]]

__all__ = ["naive_sparse_attention", "oracle_sparse_attention"]


def _as_list(value: Lengths) -> Optional[list[int]]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.tolist()]
    return [int(v) for v in value]


def _shared(t: Optional[torch.Tensor], qdim: int) -> Optional[torch.Tensor]:
    """[S, 1, D] / [B, S, 1, D] -> [S, D] / [B, S, D]."""
    if t is not None and t.dim() == qdim:
        return t.squeeze(-2)
    return t


def _one_sequence(q, qr, k, kr, ck, idx, cidx, *, scale, d_v, window, cmp_ratio, sinks, differentiable_stats):
    """Attention of one sequence: q [Lq, H, D], k [Lk, D], ck [Lk // m, D] or None."""
    lq, heads = q.shape[0], q.shape[1]
    lk = k.shape[0]
    dev = q.device
    pos = (lk - lq) + torch.arange(lq, device=dev)
    logits, masks, values, kinds = [], [], [], []

    def add_gathered(keys, rope_keys, index, valid):
        safe = index.long().clamp(0, max(keys.shape[0] - 1, 0))
        if keys.shape[0] == 0:  # nothing to gather; every entry is invalid anyway
            keys = keys.new_zeros(1, keys.shape[1])
            rope_keys = rope_keys.new_zeros(1, rope_keys.shape[1]) if rope_keys is not None else None
        g = keys[safe]                                                    # [Lq, K, D]
        l = torch.einsum("qhd,qkd->qhk", q, g)
        if rope_keys is not None:
            l = l + torch.einsum("qhd,qkd->qhk", qr, rope_keys[safe])
        logits.append(l * scale)
        masks.append(valid[:, None, :])
        values.append(g[..., :d_v])
        kinds.append("gathered")

    def add_shared(keys, rope_keys, valid):
        l = torch.einsum("qhd,kd->qhk", q, keys)
        if rope_keys is not None:
            l = l + torch.einsum("qhd,kd->qhk", qr, rope_keys)
        logits.append(l * scale)
        masks.append(valid[:, None, :])
        values.append(keys[:, :d_v])
        kinds.append("shared")

    if idx is not None:
        i = idx.long()
        add_gathered(k, kr, idx, (i >= 0) & (i < lk) & (i <= pos[:, None]))
    else:
        j = torch.arange(lk, device=dev)
        valid = j[None, :] <= pos[:, None]
        if window:
            valid = valid & (j[None, :] > pos[:, None] - window)
        add_shared(k, kr, valid)
    if ck is not None:
        lc = ck.shape[0]
        visible = (pos + 1) // cmp_ratio
        if cidx is not None:
            w = cidx.long()
            add_gathered(ck, None, cidx, (w >= 0) & (w < lc) & (w < visible[:, None]))
        else:
            w = torch.arange(lc, device=dev)
            add_shared(ck, None, w[None, :] < visible[:, None])

    logit = torch.cat(logits, dim=-1)
    mask = torch.cat([m.expand(lq, heads, m.shape[-1]) for m in masks], dim=-1)
    neg_inf = torch.tensor(float("-inf"), dtype=logit.dtype, device=dev)
    logit = torch.where(mask, logit, neg_inf)
    row_max = logit.amax(dim=-1) if logit.shape[-1] else logit.new_full((lq, heads), float("-inf"))
    # A detached shift keeps the softmax exact and its gradient untouched.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    if sinks is not None:
        sink = sinks.to(logit.dtype)[None, :].expand(lq, heads)
        shift = torch.maximum(shift, torch.where(torch.isfinite(sink), sink, shift).detach())
    e = torch.exp(logit - shift[..., None])
    denom = e.sum(dim=-1)
    if sinks is not None:
        denom = denom + torch.exp(sink - shift)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)  # empty rows; a NaN (sink) stays NaN
    p = e / denom[..., None]
    out = None
    start = 0
    for v, kind in zip(values, kinds):
        n = v.shape[-2]
        part = p[..., start:start + n]
        start += n
        o = torch.einsum("qhk,qkd->qhd", part, v) if kind == "gathered" else torch.einsum("qhk,kd->qhd", part, v)
        out = o if out is None else out + o
    with torch.set_grad_enabled(differentiable_stats and torch.is_grad_enabled()):
        # A constant shift (as the returned max is), and 0 on empty rows: no NaN anywhere
        # autograd could carry it.
        has_keys = torch.isfinite(row_max)
        stat_shift = torch.where(has_keys, row_max, torch.zeros_like(row_max)).detach()
        stat_sum = torch.where(has_keys[..., None], torch.exp(logit - stat_shift[..., None]),
                               torch.zeros_like(logit)).sum(dim=-1)
    return out, row_max.detach(), stat_sum


def naive_sparse_attention(query, kv, indices=None, *, scale, d_v=None, window=None, cmp_kv=None,
                           cmp_indices=None, cmp_ratio=1, sinks=None, query_rope=None,
                           key_rope=None, query_lengths: Lengths = None, key_lengths: Lengths = None,
                           layout="TND", differentiable_stats=False):
    """dsa_sparse_attention in plain torch ops, in the inputs' dtype (autograd backward).
    differentiable_stats: softmax_sum carries autograd (the max is a constant shift), so
    a test can differentiate the log-sum-exp; off, the peer builds no graph for it."""
    qdim = query.dim()
    kv = _shared(kv, qdim)
    key_rope = _shared(key_rope, qdim)
    cmp_kv = _shared(cmp_kv, qdim)
    if indices is not None and indices.dim() == qdim:
        indices = indices.squeeze(-2)
    if cmp_indices is not None and cmp_indices.dim() == qdim:
        cmp_indices = cmp_indices.squeeze(-2)
    d_v = d_v or kv.shape[-1]
    m = cmp_ratio
    kw = dict(scale=scale, d_v=d_v, window=window, cmp_ratio=m, sinks=sinks, differentiable_stats=differentiable_stats)
    outs, maxes, sums = [], [], []
    if layout == "TND":
        q_ends = _as_list(query_lengths) or [query.shape[0]]
        k_ends = _as_list(key_lengths) or [kv.shape[0]]
        qb = kb = cb = 0
        for qe, ke in zip(q_ends, k_ends):
            lk = ke - kb
            lc = lk // m if cmp_kv is not None else 0
            sl = slice(qb, qe)
            o, mx, sm = _one_sequence(
                query[sl], query_rope[sl] if query_rope is not None else None, kv[kb:ke],
                key_rope[kb:ke] if key_rope is not None else None,
                cmp_kv[cb:cb + lc] if cmp_kv is not None else None,
                indices[sl] if indices is not None else None,
                cmp_indices[sl] if cmp_indices is not None else None, **kw)
            outs.append(o), maxes.append(mx), sums.append(sm)
            qb, kb, cb = qe, ke, cb + lc
        return torch.cat(outs), torch.cat(maxes).float(), torch.cat(sums).float()
    batch, sq, heads = query.shape[0], query.shape[1], query.shape[2]
    q_lens = _as_list(query_lengths) or [sq] * batch
    k_lens = _as_list(key_lengths) or [kv.shape[1]] * batch
    for b in range(batch):
        lq, lk = q_lens[b], k_lens[b]
        lc = lk // m if cmp_kv is not None else 0
        o, mx, sm = _one_sequence(
            query[b, :lq], query_rope[b, :lq] if query_rope is not None else None, kv[b, :lk],
            key_rope[b, :lk] if key_rope is not None else None,
            cmp_kv[b, :lc] if cmp_kv is not None else None,
            indices[b, :lq] if indices is not None else None,
            cmp_indices[b, :lq] if cmp_indices is not None else None, **kw)
        pad = sq - lq
        outs.append(torch.cat([o, o.new_zeros(pad, heads, d_v)]))
        maxes.append(torch.cat([mx, mx.new_full((pad, heads), float("-inf"))]))
        sums.append(torch.cat([sm, sm.new_zeros(pad, heads)]))
    return torch.stack(outs), torch.stack(maxes).float(), torch.stack(sums).float()


def oracle_sparse_attention(query, kv, indices=None, **kwargs):
    """naive_sparse_attention in float64 (sinks too); outputs stay float64."""
    def up(t):
        return t.double() if t is not None and t.is_floating_point() else t
    for name in ("cmp_kv", "sinks", "query_rope", "key_rope"):
        kwargs[name] = up(kwargs.get(name))
    return naive_sparse_attention(up(query), up(kv), indices, **kwargs)
