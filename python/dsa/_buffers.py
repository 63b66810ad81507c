"""A small pool that keeps the memory of large CPU op outputs for reuse.

Why: glibc serves an allocation of 32 MiB or more with a fresh ``mmap`` and
returns it with ``munmap`` when the tensor dies, so every call of an op that
writes such an output (the compressor's ``d kv`` and ``d gate``) pays a page
fault per 4 KiB page -- on the VMs this project runs on, more time than the
kernel itself. The pool keeps freed blocks mapped and hands them out again,
as the CUDA caching allocator does on GPUs.

How: a block is an anonymous ``mmap``; a tensor is made over it with
``torch.frombuffer``, which holds one reference to the block for as long as
the tensor's storage lives. A block whose only references are the pool's own
is free. Blocks of the requested byte size are reused first; a new block is
mapped while the pool holds less than its limit; past the limit the pool
falls back to ``torch.empty``. Only CPU outputs of at least ``MIN_BYTES`` go
through it.

The limit is ``DSA_BUFFER_POOL_MIB`` (default 512; 0 turns the pool off), or
``set_buffer_pool_limit``. ``empty_buffer_pool`` unmaps the free blocks.
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import sys
import threading

import torch

from . import _C

MIN_BYTES = 1 << 20

_lock = threading.Lock()
_blocks: dict[int, list[mmap.mmap]] = {}  # byte size -> blocks (free or in use)
_limit = max(0, int(os.environ.get("DSA_BUFFER_POOL_MIB", "512"))) << 20
# References to a free block seen by sys.getrefcount inside _claim: the pool's
# list, the loop variable and getrefcount's own argument.
_FREE_REFS = 3


def _pooled_bytes() -> int:
    return sum(size * len(blocks) for size, blocks in _blocks.items())


def _claim(nbytes: int):
    for block in _blocks.get(nbytes, ()):
        if sys.getrefcount(block) == _FREE_REFS:
            return block
    if _pooled_bytes() + nbytes > _limit:
        return None
    # Private, not mmap's default shared mapping: shared anonymous memory is
    # shmem, which transparent huge pages usually skip.
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)  # fewer first-touch faults; a hint
        except OSError:
            pass
    _blocks.setdefault(nbytes, []).append(block)
    return block


def _empty(shape, dtype: torch.dtype, device: torch.device, numel: int, nbytes: int) -> torch.Tensor:
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES or _limit == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    with _lock:
        block = _claim(nbytes)
        if block is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.frombuffer(block, dtype=dtype, count=numel).view(shape)


def _out_of_memory(error: BaseException) -> bool:
    """torch's CPU allocator reports failure as a RuntimeError ("can't allocate
    memory"), mmap as OSError ENOMEM; anything else is not ours to translate."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    if isinstance(error, OSError):
        return error.errno == errno.ENOMEM
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)


def empty(shape, dtype: torch.dtype, device: torch.device, *, op: str = "dsa") -> torch.Tensor:
    """An uninitialised contiguous output of ``op``, from the pool when it is a large
    CPU one. When memory runs out, the pool's free blocks and the core's cached
    workspaces are released (they may be exactly what is missing) and the
    allocation is tried once more; then a RuntimeError names ``op`` and the bytes."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    try:
        return _empty(shape, dtype, device, numel, nbytes)
    except (RuntimeError, MemoryError, OSError) as error:
        if not _out_of_memory(error):
            raise
    empty_buffer_pool()
    try:
        return _empty(shape, dtype, device, numel, nbytes)
    except (RuntimeError, MemoryError, OSError) as error:
        if not _out_of_memory(error):
            raise
        raise RuntimeError(
            f"{op}: out of memory: could not allocate {nbytes} bytes ({nbytes / 2**20:.1f} MiB) for an "
            f"output of shape {list(shape)} ({dtype}), even after emptying dsa's buffer pool and "
            f"workspace cache") from error


def set_buffer_pool_limit(mib: int) -> None:
    """Caps the pool at ``mib`` MiB of blocks (free plus in use); 0 turns it off.
    Free blocks over the new cap are unmapped."""
    global _limit
    if not isinstance(mib, int) or isinstance(mib, bool) or mib < 0:
        raise ValueError(f"mib: expected an int >= 0, got {mib!r}")
    with _lock:
        _limit = mib << 20
        _release_free(keep_bytes=_limit)


def empty_buffer_pool() -> None:
    """Unmaps every free block (blocks still held by tensors stay) and frees the
    C++ core's idle cached workspaces (``set_workspace_cache_limit``)."""
    with _lock:
        _release_free(keep_bytes=0)
    _C.release_workspace_cache()


def set_workspace_cache_limit(mib: int) -> None:
    """Caps the C++ core's cache of idle kernel workspaces (large scratch such as
    the attention backward's packed operands, kept for the next call) at ``mib``
    MiB; 0 turns it off. Default ``DSA_WORKSPACE_CACHE_MIB``, else an eighth of
    the physical memory."""
    if not isinstance(mib, int) or isinstance(mib, bool) or mib < 0:
        raise ValueError(f"mib: expected an int >= 0, got {mib!r}")
    _C.set_workspace_cache_limit(mib << 20)


def buffer_pool_stats() -> dict:
    """``{"limit_bytes", "pooled_bytes", "free_bytes", "blocks"}`` of the output
    pool, plus ``"workspace_limit_bytes"`` and ``"workspace_cached_bytes"`` (idle)
    of the C++ core's workspace cache."""
    with _lock:
        free = sum(size for size, blocks in _blocks.items() for b in blocks
                   if sys.getrefcount(b) == _FREE_REFS)
        stats = {"limit_bytes": _limit, "pooled_bytes": _pooled_bytes(), "free_bytes": free,
                 "blocks": sum(len(b) for b in _blocks.values())}
    stats["workspace_limit_bytes"] = _C.workspace_cache_limit()
    stats["workspace_cached_bytes"] = _C.workspace_cache_bytes()
    return stats


def _release_free(keep_bytes: int) -> None:
    pooled = _pooled_bytes()
    for size in list(_blocks):
        kept = []
        for block in _blocks[size]:
            if pooled > keep_bytes and sys.getrefcount(block) == _FREE_REFS:
                block.close()
                pooled -= size
            else:
                kept.append(block)
        if kept:
            _blocks[size] = kept
        else:
            del _blocks[size]
