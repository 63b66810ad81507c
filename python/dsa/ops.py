"""The public dsa_* operators. Each op lives in its own module; this lists them."""
from .compressor import dsa_compressor
from .decode import dsa_compressor_append, dsa_indexer_decode, dsa_sparse_attention_decode
from .dense_indexer import dsa_dense_indexer_kl_loss, dsa_dense_indexer_lse
from .indexer import dsa_indexer
from .kl_loss import dsa_kl_loss
from .paged_cache import dsa_cache_gather, dsa_cache_write
from .sparse_attention import dsa_sparse_attention

__all__ = ["dsa_compressor", "dsa_indexer", "dsa_kl_loss", "dsa_dense_indexer_lse", "dsa_dense_indexer_kl_loss",
           "dsa_sparse_attention", "dsa_cache_write", "dsa_cache_gather", "dsa_indexer_decode",
           "dsa_sparse_attention_decode", "dsa_compressor_append"]
