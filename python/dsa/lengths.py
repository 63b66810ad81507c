"""Length conventions (docs/ops.md section 1) and conversions between them.

Three forms exist:

* TND ``ends``: cumulative sequence ends without a leading 0, ``[3, 7, 12]``;
* BSND ``lengths``: the valid length of each batch row, ``[3, 4, 5]``;
* ``cu_seqlens``: what the C++ core takes, with a leading 0, ``[0, 3, 7, 12]``.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

Lengths = Optional[Union[Sequence[int], torch.Tensor]]

__all__ = ["cu_seqlens_from_ends", "cu_seqlens_from_lengths", "ends_from_cu_seqlens",
           "lengths_from_cu_seqlens", "ends_from_lengths", "lengths_from_ends"]


def cu_seqlens_from_ends(ends: Sequence[int]) -> list[int]:
    return [0] + [int(e) for e in ends]


def cu_seqlens_from_lengths(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out


def ends_from_cu_seqlens(cu_seqlens: Sequence[int]) -> list[int]:
    return [int(c) for c in cu_seqlens[1:]]


def lengths_from_cu_seqlens(cu_seqlens: Sequence[int]) -> list[int]:
    return [int(b) - int(a) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]


def ends_from_lengths(lengths: Sequence[int]) -> list[int]:
    return cu_seqlens_from_lengths(lengths)[1:]


def lengths_from_ends(ends: Sequence[int]) -> list[int]:
    """Per-sequence lengths of cumulative ``ends``, which must not decrease."""
    lengths = lengths_from_cu_seqlens(cu_seqlens_from_ends(ends))
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"ends: expected non-decreasing cumulative ends, got {list(ends)} "
                             f"(entry {i} is {int(ends[i])}, below the one before it)")
    return lengths


def as_length_tensor(value: Lengths, name: str) -> Optional[torch.Tensor]:
    """Validates a user's length argument and returns it as a CPU int64 tensor.

    Runs in the public wrapper, before the torch op, so it is traceable: a
    Python list becomes a constant tensor under torch.compile.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an int32 or int64 tensor of lengths, got dtype {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor of lengths, got shape {list(value.shape)}")
        return value.to(device="cpu", dtype=torch.int64)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name}: expected a sequence of ints or an integer tensor, got {type(value).__name__}")
    items = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
                raise ValueError(f"{name}: lengths must be integers, got {v}")
            raise ValueError(f"{name}: lengths must be integers, got {v!r}")
        items.append(v)
    if not items:
        raise ValueError(f"{name}: expected at least one sequence, got an empty list")
    for i, v in enumerate(items):  # ends (TND) and row lengths (BSND) alike are never negative
        if v < 0:
            raise ValueError(f"{name}: expected values >= 0, got {v} at position {i} of {items}")
    return torch.tensor(items, dtype=torch.int64)


def to_cu_seqlens(value: Optional[torch.Tensor], layout: str) -> list[int]:
    """User form (ends for TND, per-row lengths for BSND) -> cu_seqlens; [] for None."""
    if value is None:
        return []
    items = [int(v) for v in value.tolist()]
    return cu_seqlens_from_ends(items) if layout == "TND" else cu_seqlens_from_lengths(items)
