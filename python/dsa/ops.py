"""The public dsa_* operators. Each op lives in its own module; this lists them."""
from .compressor import dsa_compressor
from .indexer import dsa_indexer

__all__ = ["dsa_compressor", "dsa_indexer"]
