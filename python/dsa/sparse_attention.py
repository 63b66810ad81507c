"""dsa_sparse_attention: sparse attention with one shared KV head (docs/ops.md 4.2)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import _C, _buffers
from ._common import check_backend, check_int, check_layout, check_tensors, num_threads
from .lengths import Lengths, as_length_tensor, to_cu_seqlens


_OP = "dsa_sparse_attention"  # the op named by allocation errors


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _value_dims(kv: torch.Tensor, d_v: int) -> int:
    return d_v if d_v > 0 else kv.shape[-1]


@torch.library.custom_op("dsa::sparse_attention_fwd", mutates_args=())
def _fwd_op(query: torch.Tensor, kv: torch.Tensor, indices: Optional[torch.Tensor],
            cmp_kv: Optional[torch.Tensor], cmp_indices: Optional[torch.Tensor],
            sinks: Optional[torch.Tensor], query_rope: Optional[torch.Tensor],
            key_rope: Optional[torch.Tensor], query_lengths: Optional[torch.Tensor],
            key_lengths: Optional[torch.Tensor], scale: float, d_v: int, window: int,
            cmp_ratio: int, layout: str, backend: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lead = query.shape[:-1]
    # Large and written in full every call: from the buffer pool (see _buffers).
    out = _buffers.empty((*lead, _value_dims(kv, d_v)), query.dtype, query.device, op=_OP)
    softmax_max = _buffers.empty(lead, torch.float32, query.device, op=_OP)
    softmax_sum = _buffers.empty(lead, torch.float32, query.device, op=_OP)
    _C.sparse_attention_fwd(
        query.contiguous(), kv.contiguous(), _contiguous(indices), _contiguous(cmp_kv),
        _contiguous(cmp_indices), _contiguous(sinks), _contiguous(query_rope), _contiguous(key_rope),
        out, softmax_max, softmax_sum, scale, d_v, window, cmp_ratio,
        to_cu_seqlens(query_lengths, layout), to_cu_seqlens(key_lengths, layout), layout, backend,
        num_threads())
    return out, softmax_max, softmax_sum


@_fwd_op.register_fake
def _(query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope, query_lengths,
      key_lengths, scale, d_v, window, cmp_ratio, layout, backend):
    lead = query.shape[:-1]
    return (query.new_empty(*lead, _value_dims(kv, d_v)),
            query.new_empty(lead, dtype=torch.float32), query.new_empty(lead, dtype=torch.float32))


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


@torch.library.custom_op("dsa::sparse_attention_bwd", mutates_args=())
def _bwd_op(grad_out: torch.Tensor, out: torch.Tensor, softmax_max: torch.Tensor,
            softmax_sum: torch.Tensor, query: torch.Tensor, kv: torch.Tensor,
            indices: Optional[torch.Tensor], cmp_kv: Optional[torch.Tensor],
            cmp_indices: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
            query_rope: Optional[torch.Tensor], key_rope: Optional[torch.Tensor],
            query_lengths: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
            scale: float, d_v: int, window: int, cmp_ratio: int, layout: str, backend: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor]:
    """Returns (d_query, d_kv, d_cmp_kv, d_sinks, d_query_rope, d_key_rope); absent inputs
    get empty tensors (custom ops cannot return None)."""
    # The large gradients come from the buffer pool (see _buffers).
    d_query = _buffers.empty(query.shape, query.dtype, query.device, op=_OP)
    d_kv = _buffers.empty(kv.shape, kv.dtype, kv.device, op=_OP)
    d_cmp = _buffers.empty(cmp_kv.shape, cmp_kv.dtype, cmp_kv.device, op=_OP) if cmp_kv is not None else None
    d_sinks = torch.empty_like(sinks, memory_format=torch.contiguous_format) if sinks is not None else None
    d_qr = _buffers.empty(query_rope.shape, query_rope.dtype, query_rope.device, op=_OP) if query_rope is not None else None
    d_kr = _buffers.empty(key_rope.shape, key_rope.dtype, key_rope.device, op=_OP) if key_rope is not None else None
    _C.sparse_attention_bwd(
        query.contiguous(), kv.contiguous(), _contiguous(indices), _contiguous(cmp_kv),
        _contiguous(cmp_indices), _contiguous(sinks), _contiguous(query_rope), _contiguous(key_rope),
        grad_out.contiguous(), out.contiguous(), softmax_max.contiguous(), softmax_sum.contiguous(),
        d_query, d_kv, d_cmp, d_sinks, d_qr, d_kr, scale, d_v, window, cmp_ratio,
        to_cu_seqlens(query_lengths, layout), to_cu_seqlens(key_lengths, layout), layout, backend,
        num_threads())
    return (d_query, d_kv, d_cmp if d_cmp is not None else _empty(query),
            d_sinks if d_sinks is not None else _empty(softmax_max),
            d_qr if d_qr is not None else _empty(query), d_kr if d_kr is not None else _empty(query))


@_bwd_op.register_fake
def _(grad_out, out, softmax_max, softmax_sum, query, kv, indices, cmp_kv, cmp_indices, sinks,
      query_rope, key_rope, query_lengths, key_lengths, scale, d_v, window, cmp_ratio, layout,
      backend):
    def like(t, fallback):
        return torch.empty_like(t) if t is not None else fallback.new_empty(0)
    return (torch.empty_like(query), torch.empty_like(kv), like(cmp_kv, query),
            like(sinks, softmax_max), like(query_rope, query), like(key_rope, query))


def _setup_context(ctx, inputs, output):
    (query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope, query_lengths,
     key_lengths, scale, d_v, window, cmp_ratio, layout, backend) = inputs
    out, softmax_max, softmax_sum = output
    ctx.save_for_backward(query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope,
                          query_lengths, key_lengths, out, softmax_max, softmax_sum)
    ctx.params = (scale, d_v, window, cmp_ratio, layout, backend)
    ctx.mark_non_differentiable(softmax_max, softmax_sum)
    # The statistics never get a gradient: without this autograd would hand the
    # backward two zero-filled [T, H] fp32 tensors on every call.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_max, grad_sum):
    if grad_out is None:  # grads are not materialized: the output got none
        return (None,) * 16
    (query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope, query_lengths,
     key_lengths, out, softmax_max, softmax_sum) = ctx.saved_tensors
    scale, d_v, window, cmp_ratio, layout, backend = ctx.params
    d_query, d_kv, d_cmp, d_sinks, d_qr, d_kr = _bwd_op(
        grad_out, out, softmax_max, softmax_sum, query, kv, indices, cmp_kv, cmp_indices, sinks,
        query_rope, key_rope, query_lengths, key_lengths, scale, d_v, window, cmp_ratio, layout,
        backend)
    return (d_query, d_kv, None, d_cmp if cmp_kv is not None else None, None,
            d_sinks if sinks is not None else None, d_qr if query_rope is not None else None,
            d_kr if key_rope is not None else None, None, None, None, None, None, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def dsa_sparse_attention(query: torch.Tensor, kv: torch.Tensor,
                         indices: Optional[torch.Tensor] = None, *, scale: float,
                         d_v: Optional[int] = None, window: Optional[int] = None,
                         cmp_kv: Optional[torch.Tensor] = None,
                         cmp_indices: Optional[torch.Tensor] = None, cmp_ratio: int = 1,
                         sinks: Optional[torch.Tensor] = None,
                         query_rope: Optional[torch.Tensor] = None,
                         key_rope: Optional[torch.Tensor] = None, query_lengths: Lengths = None,
                         key_lengths: Lengths = None, layout: str = "TND", backend: str = "auto"):
    """Sparse attention with one KV head shared by all query heads; K and V are one tensor.

    Keys are all dims of ``kv`` (plus ``key_rope``), values its first ``d_v`` dims. Query
    ``i`` attends the union of a raw part (``indices`` if given, else the causal band of
    ``window`` keys ending at its position; ``window=None``: dense causal) and, with
    ``cmp_kv``, a compressed part (``cmp_indices`` if given, else every visible compressed
    entry). Returns ``(out [T, H, d_v], softmax_max [T, H], softmax_sum [T, H])``; the
    statistics exclude ``sinks`` and are not differentiable. Differentiable in ``query``,
    ``kv``, ``query_rope``, ``key_rope``, ``cmp_kv`` and ``sinks``.
    """
    check_tensors(dict(query=query, kv=kv),
                  dict(indices=indices, cmp_kv=cmp_kv, cmp_indices=cmp_indices, sinks=sinks,
                       query_rope=query_rope, key_rope=key_rope))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    if d_v is not None:
        check_int(d_v, "d_v", 1)
    if window is not None:
        check_int(window, "window", 1)
    check_int(cmp_ratio, "cmp_ratio", 1)
    check_layout(layout)
    check_backend(backend)
    return _fwd_op(query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope,
                   as_length_tensor(query_lengths, "query_lengths"),
                   as_length_tensor(key_lengths, "key_lengths"), float(scale),
                   0 if d_v is None else d_v, 0 if window is None else window, cmp_ratio, layout,
                   backend)
