"""Model-level helpers of a DeepSeek-V4 attention layer (docs/ops.md 4.5, section 5)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .compressor import dsa_compressor
from .lengths import Lengths

__all__ = ["LayerCompressMode", "CompressedKV", "layer_compress_mode", "compress_for_layer"]


class LayerCompressMode(enum.Enum):
    NO_COMPRESS = "no_compress"          # ratio <= 1: sliding-window attention only
    COMPRESSOR_ONLY = "compressor_only"  # HCA: attend to every visible compressed entry
    INDEXER = "indexer"                  # CSA (ratio 4): compressor + indexer top-k


def layer_compress_mode(ratio: int) -> LayerCompressMode:
    """The attention mode a layer of this compress ratio runs in."""
    if isinstance(ratio, bool) or not isinstance(ratio, int):
        raise ValueError(f"ratio: expected an integer, got {ratio!r}")
    if ratio <= 1:
        return LayerCompressMode.NO_COMPRESS
    return LayerCompressMode.INDEXER if ratio == 4 else LayerCompressMode.COMPRESSOR_ONLY


@dataclass
class CompressedKV:
    mode: LayerCompressMode      # the mode this call runs in (NO_COMPRESS when nothing was compressed)
    ratio: int                   # effective ratio: 1 when the compressed part is skipped
    compressed: Optional[torch.Tensor]
    compressed_lengths: Optional[Union[list, torch.Tensor]]


def compress_for_layer(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, *,
                       ratio: int, query_lengths: Lengths = None, layout: str = "TND",
                       backend: str = "auto") -> CompressedKV:
    """Runs a layer's compressor and applies the rule of spec 4.5: when it yields
    no entry at all, the layer behaves as ratio 1 for this call and skips the
    compressed part. The compressed tensor keeps its autograd graph in both
    compressed modes (nothing is detached), so the attention's gradients reach
    the compressor."""
    mode = layer_compress_mode(ratio)
    if mode is LayerCompressMode.NO_COMPRESS:
        return CompressedKV(mode, 1, None, None)
    compressed, lengths = dsa_compressor(kv, gate, position_bias, ratio=ratio,
                                         overlap=mode is LayerCompressMode.INDEXER,
                                         query_lengths=query_lengths, layout=layout, backend=backend)
    if isinstance(lengths, torch.Tensor):
        entries = int(lengths[-1]) if layout == "TND" else int(lengths.sum())
    else:
        entries = lengths[-1] if layout == "TND" else sum(lengths)
    if entries == 0:
        return CompressedKV(LayerCompressMode.NO_COMPRESS, 1, None, None)
    return CompressedKV(mode, ratio, compressed, lengths)
