"""dsa: fused DeepSeek Sparse Attention operators (DeepSeek-V3.2 DSA, DeepSeek-V4)."""
from __future__ import annotations

import torch  # noqa: F401  (the ops register with torch.library on import)

import os

from . import _C, lengths
from ._buffers import buffer_pool_stats, empty_buffer_pool, set_buffer_pool_limit, set_workspace_cache_limit
from .ops import *  # noqa: F401,F403
from .ops import __all__ as _op_names
from .paged_cache import cache_token_bytes, new_paged_cache

__version__ = "0.1.0"

# Fused kernels run their parallel regions on PyTorch's OpenMP team when torch
# uses OpenMP (its threads keep spinning after each torch op; a pool of dsa's
# own would compete with them for the cores). DSA_THREAD_POOL=own keeps dsa's
# pool. THREAD_RUNTIME names the runtime in use ("" for dsa's pool).
THREAD_RUNTIME = _C.use_openmp_threads(
    os.environ.get("DSA_THREAD_POOL", "openmp") != "own" and "OpenMP" in torch.__config__.parallel_info())


def backends() -> list[dict]:
    """Every backend dsa knows: built or not, and whether a smoke call just ran correctly."""
    return _C.backends()


__all__ = list(_op_names) + ["backends", "lengths", "buffer_pool_stats", "empty_buffer_pool",
                              "set_buffer_pool_limit", "set_workspace_cache_limit", "cache_token_bytes",
                              "new_paged_cache", "__version__"]
