"""Plain PyTorch versions of the dsa ops, written from docs/ops.md and nothing else,
one module per op family.

In float64 they are the oracle of the Python tests; in the working dtype they are the
"naive PyTorch peer" of the benchmarks, composed of torch ops the way an unfused model
runs them. Nothing here imports the compiled extension, so the oracle is independent of
the code it checks.
"""
from .compressor import naive_compressor  # noqa: F401
from .indexer import *  # noqa: F401,F403
from .indexer import __all__ as _indexer_all
from .sparse_attention import naive_sparse_attention, oracle_sparse_attention  # noqa: F401
from .kl_loss import (naive_attention_stats, naive_dense_indexer_kl_loss,  # noqa: F401
                      naive_dense_indexer_lse, naive_kl_loss, naive_sequences)

__all__ = list(_indexer_all) + ["naive_compressor", "naive_attention_stats", "naive_dense_indexer_kl_loss",
                                "naive_dense_indexer_lse", "naive_kl_loss", "naive_sequences",
                                "naive_sparse_attention", "oracle_sparse_attention"]
