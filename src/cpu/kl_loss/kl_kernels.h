// Fused CPU sparse KL loss (docs/ops.md 4.3): the kernel tables kl_loss.cpp
// selects from (cpu/select.h). The dense indexer's KL (4.4) has its own in
// cpu/dense_indexer/dense_kl_kernels.h.
// - generic (kl_generic_sparse.h, compiled per ISA: portable, AVX2, AVX-512): every problem;
// - on bf16 pairs (kl_sparse_pairs.h), one set per product engine: AMX tiles
//   and AVX-512-BF16 vdpbf16ps. They take bf16 inputs with head counts and dims
//   the tile shapes divide (the *_supported predicates below, the same for both
//   engines).
#pragma once

#include <cstdint>

#include "cpu/isa/pair_tiles.h"
#include "ops/kl_loss.h"

namespace dsa::cpu::kl_kernels {

struct SparseKlKernels {
  const char* name;
  void (*fwd)(const SparseKlProblem&);
  void (*bwd)(const SparseKlBackwardProblem&);
};

const SparseKlKernels& portable_sparse_kernels();
const SparseKlKernels& avx2_sparse_kernels();
const SparseKlKernels& avx512_sparse_kernels();
const SparseKlKernels& avx512_bf16_sparse_kernels();
const SparseKlKernels& amx_sparse_kernels();

inline bool pair_sparse_fwd_supported(const SparseKlProblem& p) {
  const auto bf = DType::bf16;
  if (p.query.dtype != bf || p.kv.dtype != bf || p.index_query.dtype != bf || p.index_key.dtype != bf) return false;
  if (p.query_rope.present() && (p.query_rope.dtype != bf || p.key_rope.dtype != bf || p.query_rope.dim % kPairChunk))
    return false;
  return p.query.heads % 16 == 0 && p.query.dim % kPairChunk == 0 && p.index_query.heads % 32 == 0 &&
         p.index_query.dim % kPairChunk == 0;
}

inline bool pair_sparse_bwd_supported(const SparseKlBackwardProblem& p) {
  const auto bf = DType::bf16;
  return p.index_query.dtype == bf && p.index_key.dtype == bf && p.index_query.heads % 32 == 0 &&
         p.index_query.dim % kPairChunk == 0;
}

}  // namespace dsa::cpu::kl_kernels
