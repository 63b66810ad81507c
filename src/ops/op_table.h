// The op table: every op's backends and their entry points in one place
// (docs/architecture.md). An op's public function (src/ops/<op>.cpp) validates
// its arguments into the op's problem and calls dispatch(); the table says which
// function of which backend runs it. Adding a backend (CUDA) means filling its
// column in op_table.cpp, not editing the ops; adding an op means one row here
// and one there.
#pragma once

#include "core/memory.h"
#include "core/validate.h"
#include "dsa/backend.h"
#include "ops/compressor.h"
#include "ops/compressor_append.h"
#include "ops/indexer.h"
#include "ops/indexer_decode.h"
#include "ops/kl_loss.h"
#include "ops/paged_cache.h"
#include "ops/sparse_attention.h"
#include "ops/sparse_attention_decode.h"

namespace dsa::ops {

// One op: its name (the kernel name in out-of-memory errors and the spec) and
// its entry point per backend. A null entry: the backend does not run the op.
template <class Problem>
struct OpEntry {
  using Kernel = void (*)(const Problem&);
  const char* name = nullptr;
  Kernel reference = nullptr;
  Kernel cpu = nullptr;
  Kernel cuda = nullptr;

  Kernel kernel(Backend backend) const {
    switch (backend) {
      case Backend::reference: return reference;
      case Backend::cpu: return cpu;
      case Backend::cuda: return cuda;
      case Backend::automatic: break;
    }
    return nullptr;
  }
};

struct OpTable {
  OpEntry<IndexerProblem> indexer_topk;
  OpEntry<SparseAttentionProblem> sparse_attention_fwd, sparse_attention_bwd;
  OpEntry<SparseKlProblem> kl_loss_fwd;
  OpEntry<SparseKlBackwardProblem> kl_loss_bwd;
  OpEntry<DenseLseProblem> dense_indexer_lse;
  OpEntry<DenseKlProblem> dense_indexer_kl_loss_fwd, dense_indexer_kl_loss_bwd;
  OpEntry<CompressorProblem> compressor_fwd, compressor_bwd;
  OpEntry<CacheRowsProblem> cache_write, cache_gather;
  OpEntry<SparseAttentionDecodeProblem> sparse_attention_decode;
  OpEntry<IndexerDecodeProblem> indexer_decode;
  OpEntry<CompressorAppendProblem> compressor_append;

  // Calls f on every entry (a new row is added here too).
  template <class F>
  void each(const F& f) const {
    f(indexer_topk), f(sparse_attention_fwd), f(sparse_attention_bwd), f(kl_loss_fwd), f(kl_loss_bwd);
    f(dense_indexer_lse), f(dense_indexer_kl_loss_fwd), f(dense_indexer_kl_loss_bwd);
    f(compressor_fwd), f(compressor_bwd);
    f(cache_write), f(cache_gather);
    f(sparse_attention_decode), f(indexer_decode), f(compressor_append);
  }
};

const OpTable& op_table();

// True when some op has an entry for `backend` (resolve_backend refuses the others).
bool backend_built(Backend backend);

// Runs `op` of the table on a resolved backend (resolve_backend: never
// automatic). A backend without an entry for the op is refused with an error
// naming both; nothing falls back to another backend.
template <class Problem>
void dispatch(OpEntry<Problem> OpTable::*op, Backend backend, const Problem& problem) {
  const OpEntry<Problem>& entry = op_table().*op;
  const typename OpEntry<Problem>::Kernel kernel = entry.kernel(backend);
  if (!kernel)
    core::fail_unsupported(entry.name, ": backend '", backend_name(backend), "' has no kernel for this op");
  core::run_kernel(entry.name, [&] { kernel(problem); });
}

}  // namespace dsa::ops
