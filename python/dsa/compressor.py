"""dsa_compressor: DeepSeek-V4's gated per-channel softmax pooling (docs/ops.md 4.5)."""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import _C, _buffers
from ._common import check_backend, check_int, check_layout, check_tensors, named_for_profiler, num_threads, plain_eager
from .lengths import (Lengths, as_length_tensor, ends_from_lengths, lengths_from_cu_seqlens,
                      to_cu_seqlens)


def _compressed_shape(kv: torch.Tensor, ratio: int, overlap: bool, compressed_rows, layout: str):
    c = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    return (compressed_rows, c) if layout == "TND" else (kv.shape[0], kv.shape[1] // ratio, c)


def _stats_shape(compressed_shape: tuple, save: bool):
    return compressed_shape[:-1] + (3, compressed_shape[-1]) if save else (0,)


def _entry_counts(raw_lengths: list[int], ratio: int) -> list[int]:
    """Entries per sequence: L // ratio (a negative length is the kernel's to report)."""
    return [max(n, 0) // ratio for n in raw_lengths]


# The compressed length of TND depends on the length values. With lengths the
# wrapper knows as Python ints it passes the row count (`compressed_rows`), so
# the fake kernel's shape is static. With tensor lengths it passes -1: the
# kernel counts the rows itself and the fake kernel gives them an unbacked
# size, which keeps tensor lengths traceable under torch.compile.
# With `save_stats` the forward also returns the softmax statistics
# ([..., 3, c] fp32: max, 1 / sum, fp32 output) for the backward, which then
# works in one pass; otherwise the second output is empty.
def _forward_kernels(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, ratio: int,
                     overlap: bool, query_lengths: Optional[torch.Tensor], compressed_rows: int,
                     layout: str, backend: str, save_stats: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cu_seqlens = to_cu_seqlens(query_lengths, layout)
    if compressed_rows < 0 and layout == "TND":
        # Bad lengths are the kernel's to report; any row count lets it run.
        compressed_rows = sum(_entry_counts(lengths_from_cu_seqlens(cu_seqlens or [0, kv.shape[0]]), max(ratio, 1)))
    shape = _compressed_shape(kv, ratio, overlap, compressed_rows, layout)
    out = _buffers.empty(shape, kv.dtype, kv.device, op="dsa_compressor")
    stats = _buffers.empty(_stats_shape(shape, save_stats), torch.float32, kv.device, op="dsa_compressor")
    _C.compressor_fwd(kv, gate, position_bias, out, ratio, overlap, cu_seqlens, layout, backend, num_threads(),
                      stats if save_stats else None)
    return out, stats


def _backward_kernels(grad_compressed: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                      position_bias: torch.Tensor, stats: torch.Tensor, ratio: int, overlap: bool,
                      query_lengths: Optional[torch.Tensor], layout: str,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Large, and written in full every call: from the buffer pool (see _buffers).
    grad_kv = _buffers.empty(kv.shape, kv.dtype, kv.device, op="dsa_compressor")
    grad_gate = _buffers.empty(kv.shape, kv.dtype, kv.device, op="dsa_compressor")
    grad_bias = torch.empty(position_bias.shape, dtype=torch.float32, device=position_bias.device)
    _C.compressor_bwd(grad_compressed, kv, gate, position_bias, grad_kv, grad_gate, grad_bias, ratio,
                      overlap, to_cu_seqlens(query_lengths, layout), layout, backend, num_threads(),
                      stats if stats.dim() > 1 else None)
    return grad_kv, grad_gate, grad_bias


_compressor_op = torch.library.custom_op("dsa::compressor", _forward_kernels, mutates_args=())


@_compressor_op.register_fake
def _(kv, gate, position_bias, ratio, overlap, query_lengths, compressed_rows, layout, backend, save_stats):
    if compressed_rows < 0 and layout == "TND":
        compressed_rows = torch.library.get_ctx().new_dynamic_size()
    shape = _compressed_shape(kv, ratio, overlap, compressed_rows, layout)
    return kv.new_empty(shape), kv.new_empty(_stats_shape(shape, save_stats), dtype=torch.float32)


_compressor_backward_op = torch.library.custom_op("dsa::compressor_backward", _backward_kernels, mutates_args=())


@_compressor_backward_op.register_fake
def _(grad_compressed, kv, gate, position_bias, stats, ratio, overlap, query_lengths, layout, backend):
    return (kv.new_empty(kv.shape), kv.new_empty(kv.shape),
            position_bias.new_empty(position_bias.shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    kv, gate, position_bias, ratio, overlap, query_lengths, _, layout, backend, _ = inputs
    _, stats = output
    ctx.mark_non_differentiable(stats)
    # The statistics never get a gradient: without this autograd would hand the
    # backward a zero-filled tensor of their size (786 KiB per HCA call at S = 16384).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(kv, gate, position_bias, stats)
    ctx.query_lengths = query_lengths
    ctx.args = (ratio, overlap, layout, backend)


def _gradients(ctx, grad, backward_kernels):
    if grad is None:  # grads are not materialized: the compressed output got none
        return (None,) * 10
    kv, gate, position_bias, stats = ctx.saved_tensors
    ratio, overlap, layout, backend = ctx.args
    grad_kv, grad_gate, grad_bias = backward_kernels(
        grad.contiguous(), kv, gate, position_bias, stats, ratio, overlap, ctx.query_lengths, layout, backend)
    return grad_kv, grad_gate, grad_bias, None, None, None, None, None, None, None


def _backward(ctx, grad, _grad_stats):
    return _gradients(ctx, grad, _compressor_backward_op)


_compressor_op.register_autograd(_backward, setup_context=_setup_context)


_eager_backward_kernels = named_for_profiler("dsa::compressor_backward", _backward_kernels)


class _EagerCompressor(torch.autograd.Function):
    """The same forward, autograd context and backward as the custom ops, for
    plain eager calls (`plain_eager`): it skips torch.library's Python
    dispatch, which costs two to three times the kernels' own call overhead
    (one thread: ~0.4 ms of 7 ms per HCA forward + backward at S = 16384, the
    interpreter running cold after the kernels stream the caches out)."""
    forward = staticmethod(named_for_profiler("dsa::compressor", _forward_kernels))
    setup_context = staticmethod(_setup_context)

    @staticmethod
    @once_differentiable  # as the custom op: no double backward
    def backward(ctx, grad, _grad_stats):
        return _gradients(ctx, grad, _eager_backward_kernels)


# Slots per entry from which the backward starts from saved softmax statistics
# (the C++ backend's rule, read once: torch.compile cannot trace into _C).
_STATS_MIN_SLOTS = _C.compressor_stats_min_slots()


def _compressed_lengths(query_lengths: Lengths, lengths_tensor: Optional[torch.Tensor], layout: str,
                        kv: torch.Tensor, ratio: int):
    """(compressed_lengths in the user's convention, row count for the op).

    Python-int lengths stay Python ints (torch.compile sees constants); tensor
    lengths are computed on with tensor ops (traceable, no .tolist()), and the
    TND row count is left to the op (-1)."""
    if isinstance(query_lengths, torch.Tensor):
        raw = lengths_tensor if layout == "BSND" else torch.diff(lengths_tensor, prepend=lengths_tensor.new_zeros(1))
        counts = torch.div(raw.clamp_min(0), ratio, rounding_mode="floor")
        out = counts.cumsum(0) if layout == "TND" else counts
        return out.to(query_lengths.device), -1
    if query_lengths is None:
        raw = [kv.shape[0]] if layout == "TND" else [kv.shape[1]] * kv.shape[0]
    else:
        items = [int(v) for v in query_lengths]
        # Decreasing ends are the kernel's to report (naming query_lengths): no check here.
        raw = items if layout == "BSND" else lengths_from_cu_seqlens([0] + items)
    counts = _entry_counts(raw, ratio)
    return (counts if layout == "BSND" else ends_from_lengths(counts)), sum(counts)


def dsa_compressor(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, *, ratio: int,
                   overlap: Optional[bool] = None, query_lengths: Lengths = None, layout: str = "TND",
                   backend: str = "auto"):
    """DeepSeek-V4 KV compressor: gated, per-channel softmax pooling of blocks of
    ``ratio`` tokens (before the compressor's RMSNorm and RoPE).

    ``kv``, ``gate``: ``[S, coff*c]`` (TND) or ``[B, Sk, coff*c]`` (BSND), same
    dtype; ``position_bias``: ``[ratio, coff*c]`` fp32; ``coff = 2`` with
    ``overlap`` (default: ``ratio == 4``, CSA), else 1 (HCA). Per channel,
    ``compressed[w] = sum_slots softmax(gate + bias) * kv`` over the block's
    tokens, plus with overlap the previous block's tokens on channels ``[:c]``.
    Each sequence yields ``L // ratio`` entries (tail tokens dropped, zero
    gradient); a channel whose logits are all ``-inf`` gives 0.

    Returns ``(compressed, compressed_lengths)``: ``compressed`` is ``[S_cmp, c]``
    (TND) or ``[B, Sk // ratio, c]`` (BSND, rows past a row's count are 0);
    ``compressed_lengths`` follow ``query_lengths``' convention (cumulative ends
    for TND, per-row counts for BSND), as an int64 tensor on the lengths' device
    when ``query_lengths`` is a tensor, else as a list of ints.
    Differentiable in ``kv``, ``gate`` and ``position_bias``.
    """
    check_tensors(dict(kv=kv, gate=gate, position_bias=position_bias))
    check_int(ratio, "ratio", 1)
    if overlap is None:
        overlap = ratio == 4
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap: expected True, False or None, got {overlap!r}")
    check_layout(layout)
    check_backend(backend)
    lengths_tensor = as_length_tensor(query_lengths, "query_lengths")
    expected_dims = 2 if layout == "TND" else 3
    if kv.dim() != expected_dims:
        shape = "[S, C]" if layout == "TND" else "[B, Sk, C]"
        raise ValueError(f"kv: expected shape {shape}, got {list(kv.shape)}")
    out_lengths, compressed_rows = _compressed_lengths(query_lengths, lengths_tensor, layout, kv, ratio)
    # The backward starts from saved softmax statistics where the fused kernels
    # gain from it (many slots per entry) and a gradient will be taken.
    save_stats = (backend != "reference" and (2 if overlap else 1) * ratio >= _STATS_MIN_SLOTS
                  and torch.is_grad_enabled() and any(t.requires_grad for t in (kv, gate, position_bias)))
    op = _EagerCompressor.apply if plain_eager(kv, gate, position_bias, lengths_tensor) else _compressor_op
    compressed, _ = op(kv, gate, position_bias, ratio, overlap, lengths_tensor, compressed_rows, layout, backend,
                       save_stats)
    return compressed, out_lengths
