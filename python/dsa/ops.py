"""The public dsa_* operators. Each op lives in its own module; this lists them."""
from .indexer import dsa_indexer

__all__ = ["dsa_indexer"]
