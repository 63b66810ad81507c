"""Plain PyTorch versions of the dsa ops, written from docs/ops.md and nothing else.

Two uses:

* the **oracle** of the Python tests: ``oracle_*`` evaluate in float64 and apply the
  spec's exact rules (ranking with NaN below every number, ties to the smaller
  position);
* the **naive peer** of the benchmarks: ``naive_*`` compute in the inputs' dtype,
  composed of torch ops the way an unfused model runs them (full score matrix,
  einsum, relu, weighted head sum, causal mask, ``torch.topk``). They do not promise
  the spec's tie and NaN order (``torch.topk`` does not), only its values.

Nothing here imports the compiled extension, so the oracle is independent of the
code it checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

Lengths = Optional[Union[Sequence[int], torch.Tensor]]

__all__ = ["SequenceRows", "sequence_rows", "indexer_scores", "naive_indexer", "oracle_indexer"]


@dataclass(frozen=True)
class SequenceRows:
    """One sequence: rows of the flattened query tensor and of the flattened key tensor."""
    q_begin: int
    q_len: int
    key_begin: int    # first row of this sequence in the (raw or compressed) key tensor
    key_length: int   # raw key length Lk (spec: key lengths always speak of raw keys)
    entries: int      # key rows it owns: Lk, or Lk // cmp_ratio when compressed


def _as_list(value: Lengths) -> Optional[list[int]]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.tolist()]
    return [int(v) for v in value]


def sequence_rows(query_rows: int, key_rows: int, *, cmp_ratio: int = 1,
                  query_lengths: Lengths = None, key_lengths: Lengths = None,
                  layout: str = "TND", batch: int = 1) -> list[SequenceRows]:
    """Resolves the length arguments (spec section 1) into per-sequence row ranges.

    TND: ``query_rows`` = T, ``key_rows`` = S (compressed rows when ``cmp_ratio > 1``),
    lengths are cumulative ends without a leading 0. BSND: ``query_rows`` = Sq,
    ``key_rows`` = Sk per batch row, lengths are per-row valid lengths, ``batch`` = B.
    ``None`` query lengths: one full sequence (TND) / full rows (BSND). ``None`` key
    lengths: the whole key tensor when keys are raw; with ``cmp_ratio > 1`` the raw key
    lengths equal the query lengths (compressed self-attention), as the C++ core does.
    """
    m = cmp_ratio
    if layout == "TND":
        q_ends = _as_list(query_lengths) or [query_rows]
        q_lens = [e - b for b, e in zip([0] + q_ends[:-1], q_ends)]
        if key_lengths is not None:
            k_ends = _as_list(key_lengths)
            k_lens = [e - b for b, e in zip([0] + k_ends[:-1], k_ends)]
        else:
            k_lens = list(q_lens) if m > 1 else [key_rows]
        if len(k_lens) != len(q_lens):
            raise ValueError("key_lengths: expected as many sequences as query_lengths")
        out, q0, k0 = [], 0, 0
        for lq, lk in zip(q_lens, k_lens):
            n = lk // m if m > 1 else lk
            out.append(SequenceRows(q0, lq, k0, lk, n))
            q0 += lq
            k0 += n
        return out
    if layout == "BSND":
        q_lens = _as_list(query_lengths) or [query_rows] * batch
        if key_lengths is not None:
            k_lens = _as_list(key_lengths)
        else:
            k_lens = list(q_lens) if m > 1 else [key_rows] * batch
        return [SequenceRows(b * query_rows, lq, b * key_rows, lk, lk // m if m > 1 else lk)
                for b, (lq, lk) in enumerate(zip(q_lens, k_lens))]
    raise ValueError(f"layout: expected 'TND' or 'BSND', got {layout!r}")


def _visible(q_len: int, key_length: int, cmp_ratio: int, device) -> torch.Tensor:
    """Visible key entries of each query: bottom-right position pos(i) = Lk - Lq + i."""
    pos = torch.arange(q_len, device=device) + (key_length - q_len)
    return (pos + 1) // cmp_ratio if cmp_ratio > 1 else pos + 1


def indexer_scores(index_query: torch.Tensor, index_key: torch.Tensor, weights: torch.Tensor, *,
                   scale: float = 1.0, cmp_ratio: int = 1,
                   key_length: Optional[int] = None) -> torch.Tensor:
    """Scores of one sequence, ``[Lq, entries]`` in the inputs' dtype, ``-inf`` where masked.

    ``index_query [Lq, Hi, Di]``, ``index_key [>= entries, Di]`` (raw keys, or compressed
    entries when ``cmp_ratio > 1``), ``weights [Lq, Hi]``; ``key_length`` is the raw key
    length Lk (default: all keys when raw, Lq when compressed) and ``entries`` is Lk or
    Lk // cmp_ratio. ``I = scale * sum_j w[:, j] * relu(q[:, j] . k)`` (spec 4.1).
    """
    q_len = index_query.shape[0]
    if key_length is None:
        key_length = index_key.shape[0] if cmp_ratio == 1 else q_len
    entries = key_length // cmp_ratio if cmp_ratio > 1 else key_length
    key = index_key[:entries]
    logits = torch.einsum("thd,sd->ths", index_query, key)
    scores = (torch.relu(logits) * weights.to(logits.dtype).unsqueeze(-1)).sum(dim=1) * scale
    visible = _visible(q_len, key_length, cmp_ratio, scores.device)
    mask = torch.arange(entries, device=scores.device).unsqueeze(0) >= visible.unsqueeze(1)
    return scores.masked_fill(mask, float("-inf"))


def _flatten(index_query, index_key, weights, layout):
    if index_key.dim() == index_query.dim():  # [S, 1, D] / [B, S, 1, D]
        index_key = index_key.squeeze(-2)
    if layout == "TND":
        return index_query, index_key, weights, index_query.shape[0], index_key.shape[0], 1
    batch, sq, sk = index_query.shape[0], index_query.shape[1], index_key.shape[1]
    return (index_query.reshape(batch * sq, *index_query.shape[2:]),
            index_key.reshape(batch * sk, index_key.shape[-1]),
            weights.reshape(batch * sq, weights.shape[-1]), sq, sk, batch)


def _select(scores: torch.Tensor, visible: torch.Tensor, topk: int, exact: bool):
    """Per row, the best min(topk, visible) of the first `visible` columns, ascending positions.

    exact: the spec's order (NaN below every number, ties to the smaller position);
    otherwise torch.topk as a model would call it.
    """
    q_len, entries = scores.shape
    cols = torch.arange(entries, device=scores.device).unsqueeze(0)
    invisible = cols >= visible.unsqueeze(1)
    keep = min(topk, entries)
    if exact:
        # Stable sorts from the least to the most significant key: position (identity),
        # then score descending, then class (number < NaN < invisible).
        value = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
        order = torch.sort(value, dim=1, descending=True, stable=True).indices
        klass = (torch.isnan(scores).to(torch.int8) + 2 * invisible.to(torch.int8)).gather(1, order)
        order = order.gather(1, torch.sort(klass, dim=1, stable=True).indices)
        chosen = order[:, :keep]
    else:
        chosen = torch.topk(scores, keep, dim=1).indices
    valid = chosen < visible.unsqueeze(1)
    positions = torch.where(valid, chosen, torch.full_like(chosen, entries))  # invalid sort last
    positions = torch.sort(positions, dim=1).values
    valid = positions < entries
    picked = scores.gather(1, positions.clamp(max=max(entries - 1, 0))) if entries else positions.to(scores.dtype)
    indices = torch.full((q_len, topk), -1, dtype=torch.int32, device=scores.device)
    out_scores = torch.full((q_len, topk), float("-inf"), dtype=scores.dtype, device=scores.device)
    indices[:, :keep] = torch.where(valid, positions, torch.full_like(positions, -1)).to(torch.int32)
    out_scores[:, :keep] = torch.where(valid, picked, torch.full_like(picked, float("-inf")))
    return indices, out_scores


def _indexer(index_query, index_key, weights, *, topk, scale, cmp_ratio, query_lengths,
             key_lengths, layout, compute_dtype, exact):
    if layout not in ("TND", "BSND"):
        raise ValueError(f"layout: expected 'TND' or 'BSND', got {layout!r}")
    lead = index_query.shape[:-2]
    rows = _flatten(index_query, index_key, weights, layout)[0].shape[0]
    indices = torch.full((rows, topk), -1, dtype=torch.int32, device=index_query.device)
    scores = torch.full((rows, topk), float("-inf"), dtype=compute_dtype, device=index_query.device)
    for qs, s, visible in _sequence_scores(index_query, index_key, weights, scale=scale, cmp_ratio=cmp_ratio,
                                           query_lengths=query_lengths, key_lengths=key_lengths, layout=layout,
                                           dtype=compute_dtype):
        indices[qs], scores[qs] = _select(s, visible, topk, exact)
    return indices.reshape(*lead, topk), scores.reshape(*lead, topk)


def _sequence_scores(index_query, index_key, weights, *, scale, cmp_ratio, query_lengths, key_lengths, layout,
                     dtype):
    """Per sequence with queries: (its query rows as a slice of the flattened rows, their
    scores [q_len, entries] in `dtype`, each row's visible entry count)."""
    q, k, w, q_rows, k_rows, batch = _flatten(index_query, index_key, weights, layout)
    q, k, w = q.to(dtype), k.to(dtype), w.to(dtype)
    for seq in sequence_rows(q_rows, k_rows, cmp_ratio=cmp_ratio, query_lengths=query_lengths,
                             key_lengths=key_lengths, layout=layout, batch=batch):
        if seq.q_len == 0:
            continue
        qs = slice(seq.q_begin, seq.q_begin + seq.q_len)
        s = indexer_scores(q[qs], k[seq.key_begin:seq.key_begin + seq.entries], w[qs], scale=scale,
                           cmp_ratio=cmp_ratio, key_length=seq.key_length)
        yield qs, s, _visible(seq.q_len, seq.key_length, cmp_ratio, s.device)


def naive_indexer(index_query: torch.Tensor, index_key: torch.Tensor, weights: torch.Tensor, *,
                  topk: int, scale: float = 1.0, cmp_ratio: int = 1, query_lengths: Lengths = None,
                  key_lengths: Lengths = None, layout: str = "TND"):
    """dsa_indexer as an unfused model computes it, in the inputs' dtype.

    Returns ``(indices int32, scores)`` shaped like the op's (``[T, topk]`` /
    ``[B, Sq, topk]``), valid entries first in ascending position, then -1 / -inf;
    scores in the inputs' dtype. Ties and NaN follow ``torch.topk``, not the spec.
    """
    return _indexer(index_query, index_key, weights, topk=topk, scale=scale, cmp_ratio=cmp_ratio,
                    query_lengths=query_lengths, key_lengths=key_lengths, layout=layout,
                    compute_dtype=index_query.dtype, exact=False)


def oracle_indexer(index_query: torch.Tensor, index_key: torch.Tensor, weights: torch.Tensor, *,
                   topk: int, scale: float = 1.0, cmp_ratio: int = 1, query_lengths: Lengths = None,
                   key_lengths: Lengths = None, layout: str = "TND"):
    """dsa_indexer in float64 with the spec's exact ranking (NaN lowest, ties to the smaller position).

    Returns ``(indices int32, scores float64)``.
    """
    return _indexer(index_query, index_key, weights, topk=topk, scale=scale, cmp_ratio=cmp_ratio,
                    query_lengths=query_lengths, key_lengths=key_lengths, layout=layout,
                    compute_dtype=torch.float64, exact=True)


def oracle_indexer_full_scores(index_query, index_key, weights, *, scale=1.0, cmp_ratio=1,
                               query_lengths=None, key_lengths=None, layout="TND",
                               dtype=torch.float64):
    """Per flattened query row, its visible scores (1-D tensor in `dtype`); padding rows get
    an empty tensor. What the tests compare a selection against."""
    rows = _flatten(index_query, index_key, weights, layout)[0].shape[0]
    out = [index_query.new_empty(0, dtype=dtype) for _ in range(rows)]
    for qs, s, visible in _sequence_scores(index_query, index_key, weights, scale=scale, cmp_ratio=cmp_ratio,
                                           query_lengths=query_lengths, key_lengths=key_lengths, layout=layout,
                                           dtype=dtype):
        for i in range(qs.stop - qs.start):
            out[qs.start + i] = s[i, :int(visible[i])]
    return out


__all__ += ["oracle_indexer_full_scores"]
