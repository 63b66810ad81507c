"""Paged caches for decode (docs/serving.md): a uint8 tensor
``[num_blocks, block_size, token_bytes]`` per cached stream, a block table per
request, and the ops that store tokens into it and read them back.

A token record is ``dim`` fp32 or bf16 values, or with ``dtype="fp8"`` the first
``dim - rope_dim`` values in FP8 e4m3 with one fp32 power-of-two scale per 128
of them, then the last ``rope_dim`` values in bf16 (DeepSeek-V3.2's latent:
dim 576, rope_dim 64, 656 bytes; an indexer key: dim 128, 132 bytes).
"""
from __future__ import annotations

import ctypes
import functools
import sys

import torch

from . import _C
from ._common import check_backend, check_int, check_tensors, handoff, named_for_profiler, num_threads, plain_eager

CACHE_DTYPES = ("fp32", "bf16", "fp8")
DEFAULT_BLOCK_SIZE = 64


def check_cache_dtype(dtype: str) -> str:
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype: expected 'fp32', 'bf16' or 'fp8', got {dtype!r}")
    return dtype


def cache_token_bytes(dim: int, rope_dim: int = 0, dtype: str = "bf16") -> int:
    """Bytes of one token's record in a cache of this layout."""
    check_cache_dtype(dtype)
    return _C.cache_token_bytes(check_int(dim, "dim", 1), check_int(rope_dim, "rope_dim", 0), dtype)


def new_paged_cache(num_blocks: int, dim: int, *, rope_dim: int = 0, dtype: str = "bf16",
                    block_size: int = DEFAULT_BLOCK_SIZE, device=None) -> torch.Tensor:
    """A zeroed cache of ``num_blocks`` blocks of ``block_size`` tokens."""
    check_int(num_blocks, "num_blocks", 0)
    check_int(block_size, "block_size", 1)
    shape = (num_blocks, block_size, cache_token_bytes(dim, rope_dim, dtype))
    if device is not None and torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=torch.uint8, device=device)
    return huge_page_zeros(shape)


_HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise():
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # a hint: without it the cache only reads slower
        return None


def _advise_huge_pages(address: int, length: int) -> None:
    madvise = _madvise()
    if madvise is not None:
        madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(_MADV_HUGEPAGE))


def huge_page_zeros(shape) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of ``shape`` whose storage starts on a 2 MiB
    boundary and is advised into transparent huge pages (Linux, where THP is
    ``madvise`` or ``always``).

    A decode step reads scattered records of a cache of hundreds of MiB: with
    4 KiB pages nearly every record is a TLB miss and a page walk (on a VM, a
    two-level one), which made the sparse decode attention at H = 16, batch 16
    wait on translation as much as on DRAM (docs/serving.md, "Huge pages")."""
    numel = 1
    for n in shape:
        numel *= n
    if sys.platform != "linux" or numel < _HUGE_PAGE:
        return torch.zeros(shape, dtype=torch.uint8)
    raw = torch.empty(numel + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    _advise_huge_pages(raw.data_ptr() + start, numel - numel % _HUGE_PAGE)
    # Zeroed after the advice: the first touch is what takes the huge pages.
    return raw[start: start + numel].zero_().view(shape)


def _cache_write_kernel(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                        values: torch.Tensor, rope_dim: int, cache_dtype: str, ring: bool, backend: str) -> None:
    _C.cache_write(*handoff(cache, block_table, positions, values), rope_dim, cache_dtype, ring, backend,
                   num_threads())


_cache_write_op = torch.library.custom_op("dsa::cache_write", _cache_write_kernel, mutates_args=("cache",))
_cache_write_eager = named_for_profiler("dsa::cache_write", _cache_write_kernel)


@_cache_write_op.register_fake
def _(cache, block_table, positions, values, rope_dim, cache_dtype, ring, backend):
    return None


@torch.library.custom_op("dsa::cache_gather", mutates_args=())
def _cache_gather_op(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, dim: int,
                     rope_dim: int, cache_dtype: str, ring: bool, out_dtype: torch.dtype,
                     backend: str) -> torch.Tensor:
    out = torch.empty(*positions.shape, dim, dtype=out_dtype, device=cache.device)
    _C.cache_gather(cache, block_table, positions, out, rope_dim, cache_dtype, ring, backend, num_threads())
    return out


@_cache_gather_op.register_fake
def _(cache, block_table, positions, dim, rope_dim, cache_dtype, ring, out_dtype, backend):
    return cache.new_empty(*positions.shape, dim, dtype=out_dtype)


def dsa_cache_write(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                    values: torch.Tensor, *, rope_dim: int = 0, dtype: str = "bf16", ring: bool = False,
                    backend: str = "auto") -> None:
    """Stores ``values [B, n, dim]`` at ``positions [B, n]`` (absolute positions in
    each request, ``-1`` skips a row) through ``block_table [B, width]`` (int32
    block ids, ``-1`` for none), quantising where the cache is FP8. ``ring``: the
    table's columns are reused cyclically (V4's window cache). In place."""
    check_tensors(dict(cache=cache, block_table=block_table, positions=positions, values=values))
    check_cache_dtype(dtype)
    check_backend(backend)
    # A decode step writes one row per layer and stream: eager calls skip
    # torch.library's dispatch (~35 us of a ~10 us write, Zen 4), as the decode ops do.
    run = _cache_write_eager if plain_eager(cache, block_table, positions, values) else _cache_write_op
    run(cache, block_table, positions, values.detach(), check_int(rope_dim, "rope_dim", 0), dtype, bool(ring), backend)


def dsa_cache_gather(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, *, dim: int,
                     rope_dim: int = 0, dtype: str = "bf16", ring: bool = False,
                     out_dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """The tokens at ``positions [B, n]``, dequantised: ``[B, n, dim]`` in
    ``out_dtype`` (float32 or bfloat16; exact for either cache dtype's values
    in float32), zeros where a position is ``-1``."""
    check_tensors(dict(cache=cache, block_table=block_table, positions=positions))
    check_cache_dtype(dtype)
    check_backend(backend)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype: expected torch.float32 or torch.bfloat16, got {out_dtype}")
    if positions.dim() != 2:  # the output's shape follows from it: say so before the op names `out`
        raise ValueError(f"positions: expected [B, n] (one row of positions per request), got shape "
                         f"{tuple(positions.shape)}")
    return _cache_gather_op(cache, block_table, positions, check_int(dim, "dim", 1),
                            check_int(rope_dim, "rope_dim", 0), dtype, bool(ring), out_dtype, backend)
