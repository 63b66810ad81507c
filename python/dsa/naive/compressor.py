"""Naive PyTorch dsa_compressor (docs/ops.md 4.5): float64 oracle and benchmark peer."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["naive_compressor"]


def _pool_blocks(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, ratio: int,
                 overlap: bool, guard_empty: bool) -> torch.Tensor:
    """kv, gate [..., n*ratio, C] -> [..., n, c]: view, add bias, softmax, multiply, sum."""
    *lead, length, channels = kv.shape
    n = length // ratio
    if n == 0:
        return kv.new_zeros(*lead, 0, channels // 2 if overlap else channels)
    blocks_kv = kv.reshape(*lead, n, ratio, channels)
    logits = gate.reshape(*lead, n, ratio, channels) + position_bias  # fp32 (or fp64) logits
    if overlap:
        # Entry w: block w-1 on channels [:c] (absent for w = 0) then block w on [c:].
        c = channels // 2
        pad_kv = blocks_kv.new_zeros(*lead, 1, ratio, c)
        pad_logit = logits.new_full((*lead, 1, ratio, c), float("-inf"))
        previous_kv = torch.cat([pad_kv, blocks_kv[..., :-1, :, :c]], dim=-3)
        previous_logit = torch.cat([pad_logit, logits[..., :-1, :, :c]], dim=-3)
        blocks_kv = torch.cat([previous_kv, blocks_kv[..., c:]], dim=-2)
        logits = torch.cat([previous_logit, logits[..., c:]], dim=-2)
    softmax_dtype = torch.float64 if kv.dtype == torch.float64 else torch.float32
    if guard_empty:
        # spec: a channel whose logits are all -inf pools nothing (0, zero gradients).
        empty = torch.isneginf(logits.amax(dim=-2, keepdim=True))
        logits = torch.where(empty, torch.zeros_like(logits), logits)
        weights = torch.softmax(logits, dim=-2, dtype=softmax_dtype)
        weights = torch.where(empty, torch.zeros_like(weights), weights)
    else:
        weights = torch.softmax(logits, dim=-2, dtype=softmax_dtype)
    return (blocks_kv * weights.to(kv.dtype)).sum(dim=-2)


def naive_compressor(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, *, ratio: int,
                     overlap: Optional[bool] = None, query_lengths=None, layout: str = "TND",
                     guard_empty: bool = True) -> torch.Tensor:
    """docs/ops.md 4.5 in plain torch; returns the compressed tensor (TND
    [S_cmp, c], BSND [B, Sk // ratio, c] with zero rows past each row's count).
    ``guard_empty=False`` drops the all -inf rule (NaN there), as a model would."""
    if overlap is None:
        overlap = ratio == 4
    lengths = None if query_lengths is None else [int(v) for v in (
        query_lengths.tolist() if isinstance(query_lengths, torch.Tensor) else query_lengths)]
    if layout == "TND":
        ends = lengths if lengths is not None else [kv.shape[0]]
        pieces, begin = [], 0
        for end in ends:
            n = (end - begin) // ratio
            pieces.append(_pool_blocks(kv[begin:begin + n * ratio], gate[begin:begin + n * ratio],
                                       position_bias, ratio, overlap, guard_empty))
            begin = end
        return torch.cat(pieces, dim=0)
    batch, rows = kv.shape[0], kv.shape[1]
    if lengths is None or all(n == rows for n in lengths):
        usable = (rows // ratio) * ratio
        return _pool_blocks(kv[:, :usable], gate[:, :usable], position_bias, ratio, overlap, guard_empty)
    out_rows = rows // ratio
    rows_out = []
    for b, length in enumerate(lengths):
        n = length // ratio
        pooled = _pool_blocks(kv[b, :n * ratio], gate[b, :n * ratio], position_bias, ratio, overlap,
                              guard_empty)
        rows_out.append(torch.cat([pooled, pooled.new_zeros(out_rows - n, pooled.shape[-1])], dim=0))
    return torch.stack(rows_out, dim=0)
