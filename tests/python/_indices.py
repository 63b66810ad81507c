"""Random index lists the ops accept: every position inside its query's own sequence.

The ops refuse an index outside [-1, the sequence's key count) (docs/ops.md section
2), so tests that draw indices at random fold them into each sequence's range; entries
past a row's causal position, -1 and duplicates stay, which the ops skip or count.
"""
from __future__ import annotations

import torch


def fold_into_sequences(idx: torch.Tensor, q_lens, held, layout: str = "TND") -> torch.Tensor:
    """Maps, in place, the indices of sequence b's query rows into [-1, held[b]).

    q_lens / held are per sequence (not cumulative): queries and the keys (or
    compressed entries) the indices address. BSND rows past q_lens[b] are padding
    and keep what they hold (the ops never read them)."""
    flat = idx.view(-1, idx.shape[-1])
    row = 0
    for b, (lq, h) in enumerate(zip(q_lens, held)):
        start = row if layout == "TND" else b * idx.shape[1]
        part = flat[start:start + lq]
        part.copy_(torch.remainder(part + 1, h + 1) - 1)
        row += lq
    return idx
