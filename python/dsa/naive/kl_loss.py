"""Independent pure-PyTorch implementations written from docs/ops.md.

In float64 they are the test oracle; in the working dtype they are the "naive
PyTorch peer" of the benchmarks (composed of torch ops as an unfused model would
run them: gathers, einsums and full [rows, entries] / [H, T, S] matrices).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..lengths import Lengths


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _as_list(v: Lengths) -> Optional[list[int]]:
    if v is None:
        return None
    return [int(x) for x in (v.tolist() if isinstance(v, torch.Tensor) else v)]


def naive_sequences(layout: str, q_shape, k_rows: int, cmp_ratio: int, query_lengths: Lengths,
                    key_lengths: Lengths):
    """(q_begin, q_len, k_len, c_begin, c_len) per sequence, rows of the flattened tensors.

    ``k_rows``: rows per batch row (BSND) or in total (TND) of the key tensor the op
    reads (compressed entries when ``cmp_ratio > 1``).
    """
    ql, kl = _as_list(query_lengths), _as_list(key_lengths)
    m = cmp_ratio
    out = []
    if layout == "TND":
        ends_q = ql if ql is not None else [q_shape[0]]
        ends_k = kl if kl is not None else (ends_q if m > 1 else [k_rows])
        q0 = k0 = c0 = 0
        for eq, ek in zip(ends_q, ends_k):
            lq, lk = eq - q0, ek - k0
            c_len = lk // m if m > 1 else lk
            out.append((q0, lq, lk, c0, c_len))
            q0, k0, c0 = eq, ek, c0 + c_len
    else:
        B, Sq = q_shape[0], q_shape[1]
        lqs = ql if ql is not None else [Sq] * B
        lks = kl if kl is not None else (lqs if m > 1 else [k_rows] * B)
        for b in range(B):
            lq, lk = lqs[b], lks[b]
            out.append((b * Sq, lq, lk, b * k_rows, lk // m if m > 1 else lk))
    return out


def _flat(t: Optional[torch.Tensor], keep: int) -> Optional[torch.Tensor]:
    """Merges the leading dims so that `keep` trailing dims remain."""
    if t is None:
        return None
    # The row count spelled out, not -1: a reshape of 0 elements cannot infer it.
    rows = math.prod(t.shape[:t.dim() - keep])
    return t.reshape(rows, *t.shape[t.dim() - keep:]) if keep else t.reshape(-1)


def _visible(q_len: int, k_len: int, m: int, device) -> torch.Tensor:
    pos = torch.arange(q_len, device=device) + (k_len - q_len)
    return (pos + 1) // m if m > 1 else pos + 1


def _indexer_scores(iq, ik, w, index_scale):
    """I[t, s] = index_scale * sum_j w[t, j] relu(iq[t, j] . ik[s]), ik: [T, E, Di] or [S, Di]."""
    if ik.dim() == 3:
        dots = torch.einsum("tjd,ted->tje", iq, ik)
    else:
        dots = torch.einsum("tjd,sd->tjs", iq, ik)
    return index_scale * (w.unsqueeze(-1) * torch.relu(dots)).sum(1)


def naive_kl_loss(query, kv, indices, softmax_max, softmax_sum, index_query, index_key, weights, *, scale,
                  index_scale=1.0, sinks=None, cmp_ratio=1, query_rope=None, key_rope=None, query_lengths=None,
                  key_lengths=None, layout="TND", loss_coefficient=1.0, reduction="mean"):
    """docs/ops.md 4.3 with the full [rows, K] teacher matrix (differentiable like the op)."""
    bsnd = layout == "BSND"
    keep_kv = 1
    kv2 = kv.squeeze(-2) if kv.dim() == (4 if bsnd else 3) else kv
    ik2 = index_key.squeeze(-2) if index_key.dim() == (4 if bsnd else 3) else index_key
    kr2 = None if key_rope is None else (key_rope.squeeze(-2) if key_rope.dim() == (4 if bsnd else 3) else key_rope)
    idx2 = indices.squeeze(-2) if indices.dim() == (4 if bsnd else 3) else indices
    seqs = naive_sequences(layout, query.shape, kv2.shape[1] if bsnd else kv2.shape[0], cmp_ratio, query_lengths,
                           key_lengths)
    q, qr = _flat(query, 2).detach(), _flat(query_rope, 2)
    qr = None if qr is None else qr.detach()
    kvf, krf = _flat(kv2, keep_kv).detach(), _flat(kr2, 1)
    krf = None if krf is None else krf.detach()
    idx = _flat(idx2, 1).long()
    mx, sm = _flat(softmax_max, 1).detach(), _flat(softmax_sum, 1).detach()
    iq, ik, w = _flat(index_query, 2), _flat(ik2, 1), _flat(weights, 1)
    acc = _acc(q)
    total = torch.zeros((), dtype=acc)
    counted = 0
    for q0, lq, lk, c0, c_len in seqs:
        if lq == 0:
            continue
        rows = slice(q0, q0 + lq)
        ix = idx[rows]
        vis = _visible(lq, lk, cmp_ratio, ix.device)
        valid = (ix >= 0) & (ix < c_len) & (ix < vis[:, None])
        safe = torch.where(valid, ix, torch.zeros_like(ix)) + c0
        if c_len == 0:
            continue
        kg = kvf[safe]  # [lq, K, D]
        logits = torch.einsum("thd,tkd->thk", q[rows], kg).to(acc)
        if qr is not None:
            logits = logits + torch.einsum("thd,tkd->thk", qr[rows], krf[safe]).to(acc)
        logits = logits * scale
        m_, s_ = mx[rows].to(acc), sm[rows].to(acc)
        head_ok = (m_ > -math.inf) & (s_ > 0)
        m_safe = torch.where(head_ok, m_, torch.zeros_like(m_))
        den = s_ + (torch.exp(sinks.to(acc)[None, :] - m_safe) if sinks is not None else 0)
        den = torch.where(head_ok, den, torch.ones_like(den))
        P = torch.exp(logits - m_safe[..., None]) / den[..., None]
        P = torch.where(head_ok[..., None] & valid[:, None, :], P, torch.zeros_like(P))
        p_raw = P.sum(1)
        mass = p_raw.sum(-1, keepdim=True)
        p = torch.where(mass > 0, p_raw / torch.where(mass > 0, mass, torch.ones_like(mass)), torch.zeros_like(p_raw))
        score = _indexer_scores(iq[rows], ik[safe], w[rows], index_scale).to(acc)
        score = score.masked_fill(~valid, -math.inf)
        any_valid = valid.any(-1)
        log_student = torch.log_softmax(torch.where(any_valid[:, None], score, torch.zeros_like(score)), -1)
        terms = torch.where(p > 0, p * (torch.log(torch.where(p > 0, p, torch.ones_like(p))) - log_student),
                            torch.zeros_like(p))
        total = total + terms.sum()
        counted += int(any_valid.sum())
    if reduction == "mean":
        total = total / counted if counted else total * 0
    return (loss_coefficient * total).to(torch.float32 if acc == torch.float32 else acc)


def naive_dense_indexer_lse(index_query, index_key, head_weights, *, scale=1.0, cmp_ratio=1, query_lengths=None,
                            key_lengths=None, layout="TND"):
    bsnd = layout == "BSND"
    ik2 = index_key.squeeze(-2) if index_key.dim() == (4 if bsnd else 3) else index_key
    seqs = naive_sequences(layout, index_query.shape, ik2.shape[1] if bsnd else ik2.shape[0], cmp_ratio,
                           query_lengths, key_lengths)
    iq, ik, w = _flat(index_query, 2), _flat(ik2, 1), _flat(head_weights, 1)
    acc = _acc(iq)
    lse = torch.full((iq.shape[0],), math.inf, dtype=acc)
    for q0, lq, lk, c0, c_len in seqs:
        if lq == 0:
            continue
        vis = _visible(lq, lk, cmp_ratio, iq.device)
        score = _indexer_scores(iq[q0:q0 + lq], ik[c0:c0 + c_len], w[q0:q0 + lq], scale).to(acc)
        mask = torch.arange(c_len)[None, :] < vis[:, None]
        out = torch.logsumexp(score.masked_fill(~mask, -math.inf), -1)
        lse[q0:q0 + lq] = torch.where(vis > 0, out, torch.full_like(out, math.inf))
    return lse.reshape(index_query.shape[:-2]).to(torch.float32 if acc == torch.float32 else acc)


def naive_dense_indexer_kl_loss(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum,
                                indexer_lse, *, scale, index_scale=1.0, query_rope=None, key_rope=None,
                                query_lengths=None, key_lengths=None, layout="TND", loss_coefficient=1.0,
                                reduction="mean"):
    """docs/ops.md 4.4 with the full [H, Lq, Lk] teacher per sequence."""
    bsnd = layout == "BSND"
    lead = 2 if bsnd else 1
    ik2 = index_key.squeeze(-2) if index_key.dim() == lead + 2 else index_key
    key3 = key if key.dim() == lead + 2 else key.unsqueeze(-2)
    kr3 = None if key_rope is None else (key_rope if key_rope.dim() == lead + 2 else key_rope.unsqueeze(-2))
    seqs = naive_sequences(layout, index_query.shape, ik2.shape[1] if bsnd else ik2.shape[0], 1, query_lengths,
                           key_lengths)
    iq, ik, w = _flat(index_query, 2), _flat(ik2, 1), _flat(head_weights, 1)
    q, k = _flat(query, 2).detach(), _flat(key3, 2).detach()
    qr = None if query_rope is None else _flat(query_rope, 2).detach()
    kr = None if kr3 is None else _flat(kr3, 2).detach()
    mx, sm = _flat(softmax_max, 1).detach(), _flat(softmax_sum, 1).detach()
    lse = _flat(indexer_lse, 0)  # not detached: the oracle differentiates through a live lse
    H, Hk = q.shape[1], k.shape[1]
    acc = _acc(q)
    total = torch.zeros((), dtype=acc)
    counted = 0
    for q0, lq, lk, c0, _ in seqs:
        if lq == 0:
            continue
        rows = slice(q0, q0 + lq)
        kk = k[c0:c0 + lk].repeat_interleave(H // Hk, dim=1)  # [lk, H, D]
        logits = torch.einsum("thd,shd->hts", q[rows], kk).to(acc)
        if qr is not None:
            krr = kr[c0:c0 + lk].repeat_interleave(H // Hk, dim=1)
            logits = logits + torch.einsum("thd,shd->hts", qr[rows], krr).to(acc)
        logits = logits * scale
        m_, s_ = mx[rows].to(acc).T, sm[rows].to(acc).T  # [H, lq]
        head_ok = (m_ > -math.inf) & (s_ > 0)
        m_safe = torch.where(head_ok, m_, torch.zeros_like(m_))
        P = torch.exp(logits - m_safe[..., None]) / torch.where(head_ok, s_, torch.ones_like(s_))[..., None]
        vis = _visible(lq, lk, 1, q.device)
        mask = torch.arange(lk)[None, :] < vis[:, None]
        P = torch.where(head_ok[..., None] & mask[None], P, torch.zeros_like(P))
        p = P.sum(0) / H
        row_lse = lse[rows].to(acc)
        row_ok = ~torch.isposinf(row_lse) & (vis > 0)  # +inf: no visible key; a NaN lse row counts
        score = _indexer_scores(iq[rows], ik[c0:c0 + lk], w[rows], index_scale).to(acc)
        log_student = score - torch.where(row_ok, row_lse, torch.zeros_like(row_lse))[:, None]
        keep = (p != 0) & mask & row_ok[:, None]  # NaN passes
        terms = torch.where(keep, p * (torch.log(torch.where(keep, p, torch.ones_like(p))) - log_student),
                            torch.zeros_like(p))
        total = total + terms.sum()
        counted += int(row_ok.sum())
    if reduction == "mean":
        total = total / counted if counted else total * 0
    return (loss_coefficient * total).to(torch.float32 if acc == torch.float32 else acc)


def naive_attention_stats(query, key, *, scale, indices=None, cmp_ratio=1, sinks=None, query_rope=None,
                          key_rope=None, query_lengths=None, key_lengths=None, layout="TND"):
    """softmax_max / softmax_sum [rows, H] of a main attention (spec 4.2, section 2):
    over ``indices`` when given (sparse, entries of ``key`` at ratio ``cmp_ratio``),
    else over every visible key (dense causal). ``key``: [S, D] (MQA) or [S, Hk, D]."""
    bsnd = layout == "BSND"
    lead = 2 if bsnd else 1
    key3 = key if key.dim() == lead + 2 else key.unsqueeze(-2)
    kr3 = None if key_rope is None else (key_rope if key_rope.dim() == lead + 2 else key_rope.unsqueeze(-2))
    seqs = naive_sequences(layout, query.shape, key3.shape[1] if bsnd else key3.shape[0], cmp_ratio,
                           query_lengths, key_lengths)
    q, k = _flat(query, 2), _flat(key3, 2)
    qr = None if query_rope is None else _flat(query_rope, 2)
    kr = None if kr3 is None else _flat(kr3, 2)
    H, Hk = q.shape[1], k.shape[1]
    acc = _acc(q)
    mx = torch.full((q.shape[0], H), -math.inf, dtype=acc)
    sm = torch.zeros((q.shape[0], H), dtype=acc)
    idx = None if indices is None else _flat(indices.reshape(*query.shape[:-2], indices.shape[-1]), 1).long()
    for q0, lq, lk, c0, c_len in seqs:
        if lq == 0 or c_len == 0:
            continue
        rows = slice(q0, q0 + lq)
        kk = k[c0:c0 + c_len].repeat_interleave(H // Hk, dim=1)
        logits = torch.einsum("thd,shd->ths", q[rows], kk).to(acc)
        if qr is not None:
            logits = logits + torch.einsum("thd,shd->ths", qr[rows],
                                           kr[c0:c0 + c_len].repeat_interleave(H // Hk, dim=1)).to(acc)
        logits = logits * scale
        vis = _visible(lq, lk, cmp_ratio, q.device)
        if idx is None:
            count = (torch.arange(c_len)[None, :] < vis[:, None]).to(acc)
        else:
            ix = idx[rows]
            valid = (ix >= 0) & (ix < c_len) & (ix < vis[:, None])
            count = torch.zeros(lq, c_len, dtype=acc)
            count.scatter_add_(1, torch.where(valid, ix, torch.zeros_like(ix)), valid.to(acc))
        present = count > 0
        l = logits.masked_fill(~present[:, None, :], -math.inf)
        m_ = l.amax(-1)
        ok = m_ > -math.inf
        e = torch.exp(l - torch.where(ok, m_, torch.zeros_like(m_))[..., None]) * count[:, None, :]
        mx[rows] = m_
        sm[rows] = torch.where(ok, e.sum(-1), torch.zeros_like(m_))
    shape = (*query.shape[:-2], H)
    out_dtype = torch.float32 if acc == torch.float32 else acc
    return mx.reshape(shape).to(out_dtype), sm.reshape(shape).to(out_dtype)
