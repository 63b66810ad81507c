"""dsa.cp: context parallelism for the dsa ops over torch.distributed (KV all-gather;
the kernels stay CP-unaware). See docs/context_parallel.md.

Not imported by ``import dsa``: ``import dsa.cp`` explicitly."""
from .comm import all_gather_rows, tie
from .ops import (compressor, dense_indexer_kl_loss, dense_indexer_lse, gather, indexer, kl_loss, loss_for_logging,
                  shard_rows, sparse_attention, tnd_shard, zigzag_shard, zigzag_tnd_shard)
from .shard import CompressorPlan, TNDShard, ZigzagShard, ZigzagTNDShard

__all__ = ["TNDShard", "ZigzagTNDShard", "ZigzagShard", "CompressorPlan", "tnd_shard", "zigzag_tnd_shard",
           "zigzag_shard", "shard_rows", "gather",
           "all_gather_rows", "tie", "compressor", "indexer", "sparse_attention", "dense_indexer_lse", "kl_loss",
           "dense_indexer_kl_loss", "loss_for_logging"]
