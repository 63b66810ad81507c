"""Dense warm-up of the indexer (docs/ops.md 4.4): dsa_dense_indexer_lse and
dsa_dense_indexer_kl_loss. The fused backend never builds a [T, S] tensor."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C, _buffers
from ._common import check_backend, check_int, check_layout, check_tensors, num_threads
from .kl_loss import check_reduction, squeeze_head
from .lengths import Lengths, as_length_tensor, to_cu_seqlens


@torch.library.custom_op("dsa::dense_indexer_lse", mutates_args=())
def _dense_lse_op(index_query: torch.Tensor, index_key: torch.Tensor, head_weights: torch.Tensor, scale: float,
                  cmp_ratio: int, query_lengths: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                  layout: str, backend: str) -> torch.Tensor:
    lse = _buffers.empty(index_query.shape[:-2], torch.float32, index_query.device, op="dsa_dense_indexer_lse")
    _C.dense_indexer_lse(index_query, index_key, head_weights, lse, scale, cmp_ratio,
                         to_cu_seqlens(query_lengths, layout), to_cu_seqlens(key_lengths, layout), layout,
                         backend, num_threads())
    return lse


@_dense_lse_op.register_fake
def _(index_query, index_key, head_weights, scale, cmp_ratio, query_lengths, key_lengths, layout, backend):
    return index_query.new_empty(index_query.shape[:-2], dtype=torch.float32)


def dsa_dense_indexer_lse(index_query: torch.Tensor, index_key: torch.Tensor, head_weights: torch.Tensor, *,
                          scale: float = 1.0, cmp_ratio: int = 1, query_lengths: Lengths = None,
                          key_lengths: Lengths = None, layout: str = "TND", backend: str = "auto") -> torch.Tensor:
    """``indexer_lse[t] = log sum_{visible s} exp(I[t, s])`` (fp32, ``+inf`` for empty rows).

    Not differentiable: it normalises the student of ``dsa_dense_indexer_kl_loss``,
    whose gradient already accounts for it.
    """
    check_tensors(dict(index_query=index_query, index_key=index_key, head_weights=head_weights))
    check_int(cmp_ratio, "cmp_ratio", 1)
    check_layout(layout)
    check_backend(backend)
    index_key = squeeze_head(index_key, 2 if layout == "TND" else 3, "index_key")
    return _dense_lse_op(index_query.detach(), index_key.detach(), head_weights.detach(), float(scale), cmp_ratio,
                         as_length_tensor(query_lengths, "query_lengths"),
                         as_length_tensor(key_lengths, "key_lengths"), layout, backend)


@torch.library.custom_op("dsa::dense_indexer_kl_loss", mutates_args=())
def _dense_kl_op(index_query: torch.Tensor, index_key: torch.Tensor, head_weights: torch.Tensor,
                 query: torch.Tensor, key: torch.Tensor, softmax_max: torch.Tensor, softmax_sum: torch.Tensor,
                 indexer_lse: torch.Tensor, query_rope: Optional[torch.Tensor], key_rope: Optional[torch.Tensor],
                 scale: float, index_scale: float, query_lengths: Optional[torch.Tensor],
                 key_lengths: Optional[torch.Tensor], layout: str, loss_coefficient: float, reduction: str,
                 backend: str) -> torch.Tensor:
    loss = torch.empty((), dtype=torch.float32, device=query.device)
    _C.dense_indexer_kl_loss_fwd(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum,
                                 indexer_lse, query_rope, key_rope, loss, scale, index_scale,
                                 to_cu_seqlens(query_lengths, layout), to_cu_seqlens(key_lengths, layout), layout,
                                 loss_coefficient, reduction, backend, num_threads())
    return loss


@_dense_kl_op.register_fake
def _(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum, indexer_lse, query_rope,
      key_rope, scale, index_scale, query_lengths, key_lengths, layout, loss_coefficient, reduction, backend):
    return query.new_empty((), dtype=torch.float32)


@torch.library.custom_op("dsa::dense_indexer_kl_loss_backward", mutates_args=())
def _dense_kl_backward_op(index_query: torch.Tensor, index_key: torch.Tensor, head_weights: torch.Tensor,
                          query: torch.Tensor, key: torch.Tensor, softmax_max: torch.Tensor,
                          softmax_sum: torch.Tensor, indexer_lse: torch.Tensor, query_rope: Optional[torch.Tensor],
                          key_rope: Optional[torch.Tensor], grad_loss: torch.Tensor, scale: float,
                          index_scale: float, query_lengths: Optional[torch.Tensor],
                          key_lengths: Optional[torch.Tensor], layout: str, loss_coefficient: float,
                          reduction: str, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d_query = _buffers.empty(index_query.shape, index_query.dtype, index_query.device, op="dsa_dense_indexer_kl_loss")
    d_key = _buffers.empty(index_key.shape, index_key.dtype, index_key.device, op="dsa_dense_indexer_kl_loss")
    d_weights = _buffers.empty(head_weights.shape, head_weights.dtype, head_weights.device, op="dsa_dense_indexer_kl_loss")
    _C.dense_indexer_kl_loss_bwd(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum,
                                 indexer_lse, query_rope, key_rope, float(grad_loss.item()), d_query, d_key,
                                 d_weights, scale, index_scale, to_cu_seqlens(query_lengths, layout),
                                 to_cu_seqlens(key_lengths, layout), layout, loss_coefficient, reduction, backend,
                                 num_threads())
    return d_query, d_key, d_weights


@_dense_kl_backward_op.register_fake
def _(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum, indexer_lse, query_rope,
      key_rope, grad_loss, scale, index_scale, query_lengths, key_lengths, layout, loss_coefficient, reduction,
      backend):
    return (torch.empty_like(index_query, memory_format=torch.contiguous_format),
            torch.empty_like(index_key, memory_format=torch.contiguous_format),
            torch.empty_like(head_weights, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10], inputs[12], inputs[13])
    ctx.args = (inputs[10], inputs[11], inputs[14], inputs[15], inputs[16], inputs[17])


def _backward(ctx, grad_loss):
    (iq, ik, w, q, k, smax, ssum, lse, q_rope, k_rope, query_lengths, key_lengths) = ctx.saved_tensors
    scale, index_scale, layout, coefficient, reduction, backend = ctx.args
    d_query, d_key, d_weights = _dense_kl_backward_op(
        iq, ik, w, q, k, smax, ssum, lse, q_rope, k_rope, grad_loss.to(torch.float32), scale, index_scale,
        query_lengths, key_lengths, layout, coefficient, reduction, backend)
    return (d_query, d_key, d_weights) + (None,) * 15


_dense_kl_op.register_autograd(_backward, setup_context=_setup_context)


def dsa_dense_indexer_kl_loss(index_query: torch.Tensor, index_key: torch.Tensor, head_weights: torch.Tensor,
                              query: torch.Tensor, key: torch.Tensor, softmax_max: torch.Tensor,
                              softmax_sum: torch.Tensor, indexer_lse: torch.Tensor, *, scale: float,
                              index_scale: float = 1.0, query_rope: Optional[torch.Tensor] = None,
                              key_rope: Optional[torch.Tensor] = None, query_lengths: Lengths = None,
                              key_lengths: Lengths = None, layout: str = "TND", loss_coefficient: float = 1.0,
                              reduction: str = "mean", backend: str = "auto") -> torch.Tensor:
    """KL of the indexer's dense softmax from the dense main attention (head-averaged).

    ``query [T, H, D]``, ``key [S, Hk, D]`` (``H % Hk == 0``; MHA or MQA), the dense
    attention's ``softmax_max`` / ``softmax_sum`` and ``indexer_lse`` from
    ``dsa_dense_indexer_lse``. Returns an fp32 scalar; gradients reach
    ``index_query``, ``index_key`` and ``head_weights`` only.
    """
    check_tensors(dict(index_query=index_query, index_key=index_key, head_weights=head_weights, query=query,
                       key=key, softmax_max=softmax_max, softmax_sum=softmax_sum, indexer_lse=indexer_lse))
    check_layout(layout)
    check_backend(backend)
    check_reduction(reduction)
    index_key = squeeze_head(index_key, 2 if layout == "TND" else 3, "index_key")
    detach = lambda t: None if t is None else t.detach()  # noqa: E731
    return _dense_kl_op(index_query, index_key, head_weights, query.detach(), key.detach(), softmax_max.detach(),
                        softmax_sum.detach(), indexer_lse.detach(), detach(query_rope), detach(key_rope),
                        float(scale), float(index_scale), as_length_tensor(query_lengths, "query_lengths"),
                        as_length_tensor(key_lengths, "key_lengths"), layout, float(loss_coefficient), reduction,
                        backend)
