"""Decode operators (docs/serving.md): the lightning indexer's top-k and the
sparse attention for the newest ``next_n`` rows of each request, reading the
cached keys in place through the block tables (nothing gathered, nothing
proportional to the context allocated), and DeepSeek-V4's compressor fed a few
tokens at a time from a per-request state (``dsa_compressor_append``).

``context_lens[b]`` counts request b's tokens, the new rows included: row j of
``next_n`` sits at position ``context_lens[b] - next_n + j``.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _C
from ._common import (check_backend, check_int, check_tensors, handoff, named_for_profiler, num_threads,
                      plain_eager)
from .paged_cache import check_cache_dtype


def _eager(*tensors) -> bool:
    """Whether a decode op's call may skip torch.library's dispatch (~35-50 us a call,
    Zen 4: a decode step makes several per layer): plain eager CPU tensors, none
    requiring a gradient where autograd records (the decode ops have none; through the
    custom op such a call keeps torch's own behaviour). Under no_grad, as generate()
    runs, a model's sinks still say requires_grad: they do not send the call there."""
    return plain_eager(*tensors) and not (torch.is_grad_enabled()
                                          and any(t is not None and t.requires_grad for t in tensors))


def _indexer_decode_kernel(index_query: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor, topk: int, scale: float,
                           cmp_ratio: int, cache_dtype: str, backend: str) -> torch.Tensor:
    indices = torch.empty(*index_query.shape[:2], topk, dtype=torch.int32, device=index_query.device)
    _C.indexer_decode(*handoff(index_query, weights, key_cache, block_table, context_lens, indices), topk, scale,
                      cmp_ratio, cache_dtype, backend, num_threads())
    return indices


_indexer_decode_op = torch.library.custom_op("dsa::indexer_decode", _indexer_decode_kernel, mutates_args=())
_indexer_decode_eager = named_for_profiler("dsa::indexer_decode", _indexer_decode_kernel)


@_indexer_decode_op.register_fake
def _(index_query, weights, key_cache, block_table, context_lens, topk, scale, cmp_ratio, cache_dtype, backend):
    return index_query.new_empty(*index_query.shape[:2], topk, dtype=torch.int32)


def dsa_indexer_decode(index_query: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                       block_table: torch.Tensor, context_lens: torch.Tensor, *, topk: int, scale: float = 1.0,
                       cmp_ratio: int = 1, cache_dtype: str = "bf16", backend: str = "auto") -> torch.Tensor:
    """Top-``topk`` key positions ``[B, next_n, topk]`` (int32, ascending, then -1)
    for index queries ``[B, next_n, Hi, Di]`` with head weights ``[B, next_n, Hi]``
    over the index keys of ``key_cache`` (a paged cache of ``Di`` values per key,
    ``cache_dtype`` "bf16", "fp8" or "fp32"), as ``dsa_indexer`` selects on the
    gathered keys. ``cmp_ratio > 1``: the cache holds compressed keys (one per
    ``cmp_ratio`` tokens, V4's CSA), and a row sees those completed before it."""
    check_tensors(dict(index_query=index_query, weights=weights, key_cache=key_cache, block_table=block_table,
                       context_lens=context_lens))
    check_cache_dtype(cache_dtype)
    check_backend(backend)
    run = _indexer_decode_eager if _eager(index_query, weights, key_cache, block_table, context_lens) \
        else _indexer_decode_op
    return run(index_query, weights, key_cache, block_table, context_lens, check_int(topk, "topk", 1), float(scale),
               check_int(cmp_ratio, "cmp_ratio", 1), cache_dtype, backend)


def _sparse_attention_decode_kernel(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                context_lens: torch.Tensor, indices: Optional[torch.Tensor],
                                topk_lens: Optional[torch.Tensor], cmp_cache: Optional[torch.Tensor],
                                cmp_block_table: Optional[torch.Tensor], cmp_indices: Optional[torch.Tensor],
                                sinks: Optional[torch.Tensor], scale: float, d_v: int, window: int, cmp_ratio: int,
                                rope_dim: int, cache_dtype: str, ring: bool, cmp_cache_dtype: str,
                                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    B, n, H, D = query.shape
    out = torch.empty(B, n, H, d_v or D, dtype=query.dtype, device=query.device)
    lse = torch.empty(B, n, H, dtype=torch.float32, device=query.device)
    _C.sparse_attention_decode(*handoff(query, kv_cache, block_table, context_lens, indices, topk_lens, cmp_cache,
                                        cmp_block_table, cmp_indices, sinks, out, lse),
                               scale, d_v, window, cmp_ratio, rope_dim, cache_dtype, ring, cmp_cache_dtype, backend,
                               num_threads())
    return out, lse


_sparse_attention_decode_op = torch.library.custom_op("dsa::sparse_attention_decode",
                                                      _sparse_attention_decode_kernel, mutates_args=())
_sparse_attention_decode_eager = named_for_profiler("dsa::sparse_attention_decode", _sparse_attention_decode_kernel)


@_sparse_attention_decode_op.register_fake
def _(query, kv_cache, block_table, context_lens, indices, topk_lens, cmp_cache, cmp_block_table, cmp_indices,
      sinks, scale, d_v, window, cmp_ratio, rope_dim, cache_dtype, ring, cmp_cache_dtype, backend):
    B, n, H, D = query.shape
    return query.new_empty(B, n, H, d_v or D), query.new_empty(B, n, H, dtype=torch.float32)


def dsa_sparse_attention_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                context_lens: torch.Tensor, *, scale: float, d_v: int = 0,
                                indices: Optional[torch.Tensor] = None, topk_lens: Optional[torch.Tensor] = None,
                                window: int = 0, rope_dim: int = 0, cache_dtype: str = "bf16", ring: bool = False,
                                cmp_cache: Optional[torch.Tensor] = None,
                                cmp_block_table: Optional[torch.Tensor] = None,
                                cmp_indices: Optional[torch.Tensor] = None, cmp_ratio: int = 1,
                                cmp_cache_dtype: Optional[str] = None, sinks: Optional[torch.Tensor] = None,
                                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of ``query [B, next_n, H, D]`` (one shared KV head: V3.2's
    absorbed MLA, D = 576, d_v = 512) over the cached tokens of ``kv_cache``:
    ``indices [B, next_n, K]`` (positions, e.g. ``dsa_indexer_decode``'s; -1,
    entries at or past ``topk_lens[b]`` and positions after the row skipped) or,
    without them, the last ``window`` tokens (0: all). DeepSeek-V4: ``cmp_cache``
    of compressed entries (``cmp_indices`` positions in it, or every visible one)
    and per-head ``sinks``. Returns ``out [B, next_n, H, d_v]`` (query's dtype)
    and ``lse [B, next_n, H]`` (fp32, without the sink; -inf for no keys)."""
    check_tensors(dict(query=query, kv_cache=kv_cache, block_table=block_table, context_lens=context_lens),
                  dict(indices=indices, topk_lens=topk_lens, cmp_cache=cmp_cache, cmp_block_table=cmp_block_table,
                       cmp_indices=cmp_indices, sinks=sinks))
    if query.dim() != 4:
        raise ValueError(f"query: expected [B, next_n, H, D], got shape {tuple(query.shape)}")
    check_cache_dtype(cache_dtype)
    cmp_cache_dtype = check_cache_dtype(cmp_cache_dtype or cache_dtype)
    check_backend(backend)
    run = (_sparse_attention_decode_eager
           if _eager(query, kv_cache, block_table, context_lens, indices, topk_lens, cmp_cache, cmp_block_table,
                     cmp_indices, sinks)
           else _sparse_attention_decode_op)
    return run(query, kv_cache, block_table, context_lens, indices, topk_lens, cmp_cache, cmp_block_table,
               cmp_indices, sinks, float(scale), check_int(d_v, "d_v", 0), check_int(window, "window", 0),
               check_int(cmp_ratio, "cmp_ratio", 1), check_int(rope_dim, "rope_dim", 0), cache_dtype, bool(ring),
               cmp_cache_dtype, backend)


def _compressor_append_kernel(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                              state_kv: torch.Tensor, state_gate: torch.Tensor, lengths: torch.Tensor,
                              new_lens: Optional[torch.Tensor], ratio: int, overlap: bool,
                              backend: str) -> torch.Tensor:
    B, n, C = kv.shape
    out = torch.empty(B, -(-n // max(ratio, 1)), C // 2 if overlap else C, dtype=kv.dtype, device=kv.device)
    _C.compressor_append(*handoff(kv, gate, position_bias, state_kv, state_gate, lengths, new_lens, out), ratio,
                         overlap, backend, num_threads())
    return out


_compressor_append_op = torch.library.custom_op("dsa::compressor_append", _compressor_append_kernel,
                                                mutates_args=("state_kv", "state_gate"))
_compressor_append_eager = named_for_profiler("dsa::compressor_append", _compressor_append_kernel)


@_compressor_append_op.register_fake
def _(kv, gate, position_bias, state_kv, state_gate, lengths, new_lens, ratio, overlap, backend):
    B, n, C = kv.shape
    return kv.new_empty(B, -(-n // max(ratio, 1)), C // 2 if overlap else C)


def compressor_state_rows(ratio: int, overlap: bool) -> int:
    """Ring rows R of a ``dsa_compressor_append`` state: ``(2 if overlap else 1) * ratio``."""
    return _C.compressor_state_rows(check_int(ratio, "ratio", 1), bool(overlap))


def new_compressor_state(batch: int, ratio: int, channels: int, *, overlap: bool, device=None):
    """Zeroed ``(state_kv, state_gate)`` of ``batch`` requests: ``[batch, R, channels]``
    fp32 each (``channels`` = C, the last dim of kv: ``2 * c`` with overlap)."""
    shape = (check_int(batch, "batch", 0), compressor_state_rows(ratio, overlap), check_int(channels, "channels", 1))
    return (torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device))


def dsa_compressor_append(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                          state_kv: torch.Tensor, state_gate: torch.Tensor, lengths: torch.Tensor, *, ratio: int,
                          overlap: Optional[bool] = None, new_lens: Optional[torch.Tensor] = None,
                          backend: str = "auto") -> torch.Tensor:
    """DeepSeek-V4's compressor over new tokens: appends ``kv, gate [B, n, C]``
    (``new_lens[b] <= n`` rows of request b; all ``n`` without it) to requests that
    already hold ``lengths[b]`` tokens, and returns the entries they complete,
    ``[B, ceil(n / ratio), c]`` (request b's first ``(lengths[b] + new_lens[b]) // ratio
    - lengths[b] // ratio`` rows, zeros after). ``state_kv`` / ``state_gate``
    (``new_compressor_state``) carry the tokens later entries need, updated in
    place; the caller advances ``lengths``. Equal to ``dsa_compressor`` on the whole
    sequence (bit for bit in fp32). ``overlap``: None means ``ratio == 4`` (CSA).
    No gradient: a decode op."""
    check_tensors(dict(kv=kv, gate=gate, position_bias=position_bias, state_kv=state_kv, state_gate=state_gate,
                       lengths=lengths), dict(new_lens=new_lens))
    ratio = check_int(ratio, "ratio", 1)
    if kv.dim() != 3:
        raise ValueError(f"kv: expected [B, n, C], got shape {tuple(kv.shape)}")
    check_backend(backend)
    overlap = ratio == 4 if overlap is None else bool(overlap)
    # A decode step's call is tens of microseconds of work: eager calls skip
    # torch.library's dispatch (measured ~50 us a call, Zen 4), as dsa_compressor's do.
    run = (_compressor_append_eager if plain_eager(kv, gate, position_bias, state_kv, state_gate, lengths, new_lens)
           else _compressor_append_op)
    return run(kv.detach(), gate.detach(), position_bias.detach(), state_kv, state_gate, lengths,
                                 new_lens, ratio, overlap, backend)
