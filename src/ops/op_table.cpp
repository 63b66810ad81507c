// The op table's rows (op_table.h): one per op, one column per backend.
#include "ops/op_table.h"

namespace dsa::ops {

const OpTable& op_table() {
  static const OpTable table{
      .indexer_topk = {"indexer_topk", reference::indexer_topk, cpu::indexer_topk},
      .sparse_attention_fwd = {"sparse_attention_fwd", reference::sparse_attention_fwd, cpu::sparse_attention_fwd},
      .sparse_attention_bwd = {"sparse_attention_bwd", reference::sparse_attention_bwd, cpu::sparse_attention_bwd},
      .kl_loss_fwd = {"kl_loss_fwd", reference::kl_loss_fwd, cpu::kl_loss_fwd},
      .kl_loss_bwd = {"kl_loss_bwd", reference::kl_loss_bwd, cpu::kl_loss_bwd},
      .dense_indexer_lse = {"dense_indexer_lse", reference::dense_indexer_lse, cpu::dense_indexer_lse},
      .dense_indexer_kl_loss_fwd = {"dense_indexer_kl_loss_fwd", reference::dense_indexer_kl_loss_fwd,
                                    cpu::dense_indexer_kl_loss_fwd},
      .dense_indexer_kl_loss_bwd = {"dense_indexer_kl_loss_bwd", reference::dense_indexer_kl_loss_bwd,
                                    cpu::dense_indexer_kl_loss_bwd},
      .compressor_fwd = {"compressor_fwd", reference::compressor_fwd, cpu::compressor_fwd},
      .compressor_bwd = {"compressor_bwd", reference::compressor_bwd, cpu::compressor_bwd},
      .cache_write = {"cache_write", reference::cache_write, cpu::cache_write},
      .cache_gather = {"cache_gather", reference::cache_gather, cpu::cache_gather},
      .sparse_attention_decode = {"sparse_attention_decode", reference::sparse_attention_decode,
                                  cpu::sparse_attention_decode},
      .indexer_decode = {"indexer_decode", reference::indexer_decode, cpu::indexer_decode},
      .compressor_append = {"compressor_append", reference::compressor_append, cpu::compressor_append},
  };
  return table;
}

bool backend_built(Backend backend) {
  bool built = false;
  op_table().each([&](const auto& entry) { built = built || entry.kernel(backend) != nullptr; });
  return built;
}

}  // namespace dsa::ops
