"""The public dsa_* operators. Each op lives in its own module; this lists them."""
from .indexer import dsa_indexer
from .sparse_attention import dsa_sparse_attention

__all__ = ["dsa_indexer", "dsa_sparse_attention"]
