"""dsa_indexer: the lightning indexer with top-k selection (docs/ops.md 4.1)."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C, _buffers
from ._common import check_backend, check_int, check_layout, check_tensors, num_threads
from .lengths import Lengths, as_length_tensor, to_cu_seqlens


@torch.library.custom_op("dsa::indexer", mutates_args=())
def _indexer_op(index_query: torch.Tensor, index_key: torch.Tensor, weights: torch.Tensor,
                topk: int, scale: float, cmp_ratio: int, query_lengths: Optional[torch.Tensor],
                key_lengths: Optional[torch.Tensor], layout: str, with_scores: bool,
                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    lead = index_query.shape[:-2]
    # Large and written in full every call: from the buffer pool (see _buffers).
    indices = _buffers.empty((*lead, topk), torch.int32, index_query.device, op="dsa_indexer")
    scores = (_buffers.empty((*lead, topk), torch.float32, index_query.device, op="dsa_indexer")
              if with_scores else torch.empty(0, dtype=torch.float32, device=index_query.device))
    _C.indexer_topk(index_query, index_key, weights, indices, scores if with_scores else None,
                    topk, scale, cmp_ratio, to_cu_seqlens(query_lengths, layout),
                    to_cu_seqlens(key_lengths, layout), layout, backend, num_threads())
    return indices, scores


@_indexer_op.register_fake
def _(index_query, index_key, weights, topk, scale, cmp_ratio, query_lengths, key_lengths,
      layout, with_scores, backend):
    lead = index_query.shape[:-2]
    indices = index_query.new_empty(*lead, topk, dtype=torch.int32)
    scores = (index_query.new_empty(*lead, topk, dtype=torch.float32) if with_scores
              else index_query.new_empty(0, dtype=torch.float32))
    return indices, scores


def dsa_indexer(index_query: torch.Tensor, index_key: torch.Tensor, weights: torch.Tensor, *,
                topk: int, scale: float = 1.0, cmp_ratio: int = 1, query_lengths: Lengths = None,
                key_lengths: Lengths = None, layout: str = "TND", return_scores: bool = False,
                backend: str = "auto"):
    """Top-k keys per query by the lightning indexer score.

    ``I[t, s] = scale * sum_j weights[t, j] * relu(index_query[t, j] . index_key[s])``
    over the keys visible to each query (bottom-right causal alignment; compressed
    entries when ``cmp_ratio > 1``). Returns int32 ``indices [T, topk]`` (local to
    the query's sequence, ascending, ``-1`` padded) and, with ``return_scores``,
    fp32 ``scores`` aligned with them (``-inf`` at padding). Not differentiable.
    """
    check_tensors(dict(index_query=index_query, index_key=index_key, weights=weights))
    check_int(topk, "topk", 1)
    if topk > 2 ** 31 - 1:  # before the output [T, topk] is allocated
        raise ValueError(f"topk: expected at most 2^31 - 1 (positions are int32), got {topk}")
    check_int(cmp_ratio, "cmp_ratio", 1)
    check_layout(layout)
    check_backend(backend)
    # [S, 1, D] / [B, S, 1, D]: one shared head. Decided by the layout's rank, not by
    # index_query's, so that a query of the wrong rank is reported as such.
    if index_key.dim() == (3 if layout == "TND" else 4):
        if index_key.shape[-2] != 1:
            raise ValueError(f"index_key: expected one shared key head, got shape {list(index_key.shape)}")
        index_key = index_key.squeeze(-2)
    # The top-k selection carries no gradient; the indexer learns through the KL losses.
    indices, scores = _indexer_op(
        index_query.detach(), index_key.detach(), weights.detach(), topk, float(scale), cmp_ratio,
        as_length_tensor(query_lengths, "query_lengths"), as_length_tensor(key_lengths, "key_lengths"),
        layout, bool(return_scores), backend)
    return (indices, scores) if return_scores else indices
