"""dsa_kl_loss: the sparse indexer KL loss (docs/ops.md 4.3)."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C, _buffers
from ._common import check_backend, check_int, check_layout, check_tensors, num_threads
from .lengths import Lengths, as_length_tensor, to_cu_seqlens

REDUCTIONS = ("mean", "sum")


def check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    return reduction


def squeeze_head(t: Optional[torch.Tensor], rank: int, name: str) -> Optional[torch.Tensor]:
    """[S, 1, D] -> [S, D] (and [B, S, 1, D] -> [B, S, D]) for one-head tensors."""
    if t is None or t.dim() != rank + 1:
        return t
    if t.shape[-2] != 1:
        raise ValueError(f"{name}: expected one shared head, got shape {list(t.shape)}")
    return t.squeeze(-2)


@torch.library.custom_op("dsa::kl_loss", mutates_args=())
def _kl_loss_op(query: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_max: torch.Tensor,
                softmax_sum: torch.Tensor, index_query: torch.Tensor, index_key: torch.Tensor,
                weights: torch.Tensor, sinks: Optional[torch.Tensor], query_rope: Optional[torch.Tensor],
                key_rope: Optional[torch.Tensor], scale: float, index_scale: float, cmp_ratio: int,
                query_lengths: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor], layout: str,
                loss_coefficient: float, reduction: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    loss = torch.empty((), dtype=torch.float32, device=query.device)
    score_grad = _buffers.empty(indices.shape, torch.float32, query.device, op="dsa_kl_loss")
    _C.kl_loss_fwd(query, kv, indices, softmax_max, softmax_sum, index_query, index_key, weights, sinks,
                   query_rope, key_rope, loss, score_grad, scale, index_scale, cmp_ratio,
                   to_cu_seqlens(query_lengths, layout), to_cu_seqlens(key_lengths, layout), layout,
                   loss_coefficient, reduction, backend, num_threads())
    return loss, score_grad


@_kl_loss_op.register_fake
def _(query, kv, indices, softmax_max, softmax_sum, index_query, index_key, weights, sinks, query_rope,
      key_rope, scale, index_scale, cmp_ratio, query_lengths, key_lengths, layout, loss_coefficient,
      reduction, backend):
    return (query.new_empty((), dtype=torch.float32),
            query.new_empty(indices.shape, dtype=torch.float32))


@torch.library.custom_op("dsa::kl_loss_backward", mutates_args=())
def _kl_loss_backward_op(indices: torch.Tensor, index_query: torch.Tensor, index_key: torch.Tensor,
                         weights: torch.Tensor, score_grad: torch.Tensor, grad_loss: torch.Tensor,
                         index_scale: float, cmp_ratio: int, query_lengths: Optional[torch.Tensor],
                         key_lengths: Optional[torch.Tensor], layout: str,
                         backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d_query = _buffers.empty(index_query.shape, index_query.dtype, index_query.device, op="dsa_kl_loss")
    d_key = _buffers.empty(index_key.shape, index_key.dtype, index_key.device, op="dsa_kl_loss")
    d_weights = _buffers.empty(weights.shape, weights.dtype, weights.device, op="dsa_kl_loss")
    _C.kl_loss_bwd(indices, index_query, index_key, weights, score_grad, float(grad_loss.item()), d_query,
                   d_key, d_weights, index_scale, cmp_ratio, to_cu_seqlens(query_lengths, layout),
                   to_cu_seqlens(key_lengths, layout), layout, backend, num_threads())
    return d_query, d_key, d_weights


@_kl_loss_backward_op.register_fake
def _(indices, index_query, index_key, weights, score_grad, grad_loss, index_scale, cmp_ratio,
      query_lengths, key_lengths, layout, backend):
    return (torch.empty_like(index_query, memory_format=torch.contiguous_format),
            torch.empty_like(index_key, memory_format=torch.contiguous_format),
            torch.empty_like(weights, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    (_, _, indices, _, _, index_query, index_key, weights, _, _, _, _, index_scale, cmp_ratio,
     query_lengths, key_lengths, layout, _, _, backend) = inputs
    ctx.save_for_backward(indices, index_query, index_key, weights, output[1], query_lengths, key_lengths)
    ctx.args = (index_scale, cmp_ratio, layout, backend)


def _backward(ctx, grad_loss, _grad_score_grad):
    indices, index_query, index_key, weights, score_grad, query_lengths, key_lengths = ctx.saved_tensors
    index_scale, cmp_ratio, layout, backend = ctx.args
    d_query, d_key, d_weights = _kl_loss_backward_op(
        indices, index_query, index_key, weights, score_grad, grad_loss.to(torch.float32), index_scale,
        cmp_ratio, query_lengths, key_lengths, layout, backend)
    return (None, None, None, None, None, d_query, d_key, d_weights) + (None,) * 12


_kl_loss_op.register_autograd(_backward, setup_context=_setup_context)


def dsa_kl_loss(query: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_max: torch.Tensor,
                softmax_sum: torch.Tensor, index_query: torch.Tensor, index_key: torch.Tensor,
                weights: torch.Tensor, *, scale: float, index_scale: float = 1.0,
                sinks: Optional[torch.Tensor] = None, cmp_ratio: int = 1,
                query_rope: Optional[torch.Tensor] = None, key_rope: Optional[torch.Tensor] = None,
                query_lengths: Lengths = None, key_lengths: Lengths = None, layout: str = "TND",
                loss_coefficient: float = 1.0, reduction: str = "mean", backend: str = "auto") -> torch.Tensor:
    """KL divergence of the indexer's softmax from the main attention on the selected entries.

    Teacher: the main attention's probabilities at ``indices`` (from ``query``, ``kv``
    and its forward ``softmax_max`` / ``softmax_sum``, with ``sinks``), summed over
    heads and L1-normalised per row; student: softmax of the indexer scores over the
    same entries. Returns the fp32 scalar ``loss_coefficient * sum_t KL_t`` divided by
    the number of rows with a valid entry for ``reduction="mean"``. Gradients reach
    ``index_query``, ``index_key`` and ``weights`` only; the teacher is detached.
    """
    check_tensors(dict(query=query, kv=kv, indices=indices, softmax_max=softmax_max, softmax_sum=softmax_sum,
                       index_query=index_query, index_key=index_key, weights=weights))
    check_int(cmp_ratio, "cmp_ratio", 1)
    check_layout(layout)
    check_backend(backend)
    check_reduction(reduction)
    rank = 2 if layout == "TND" else 3
    kv = squeeze_head(kv, rank, "kv")
    key_rope = squeeze_head(key_rope, rank, "key_rope")
    index_key = squeeze_head(index_key, rank, "index_key")
    indices = squeeze_head(indices, rank, "indices")
    detach = lambda t: None if t is None else t.detach()  # noqa: E731
    loss, _ = _kl_loss_op(
        query.detach(), kv.detach(), indices.detach(), softmax_max.detach(), softmax_sum.detach(), index_query,
        index_key, weights, detach(sinks), detach(query_rope), detach(key_rope), float(scale),
        float(index_scale), cmp_ratio, as_length_tensor(query_lengths, "query_lengths"),
        as_length_tensor(key_lengths, "key_lengths"), layout, float(loss_coefficient), reduction, backend)
    return loss
