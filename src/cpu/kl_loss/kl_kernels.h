// Fused CPU KL losses (docs/ops.md 4.3, 4.4): the kernel tables kl_loss.cpp
// selects from (cpu/select.h).
// - generic (kl_generic_{common,sparse,dense}.h, compiled per ISA: portable, AVX2, AVX-512): every problem;
// - on bf16 pairs (sparse: kl_sparse_pairs.h, dense: kl_dense_pairs.h), one
//   set per product engine: AMX tiles and AVX-512-BF16 vdpbf16ps. They take bf16
//   inputs with head counts and dims the tile shapes divide (the *_supported
//   predicates below, the same for both engines).
#pragma once

#include <cstdint>

#include "ops/kl_loss.h"

namespace dsa::cpu::kl_kernels {

struct SparseKlKernels {
  const char* name;
  void (*fwd)(const SparseKlProblem&);
  void (*bwd)(const SparseKlBackwardProblem&);
};

struct DenseKlKernels {
  const char* name;
  void (*fwd)(const DenseKlProblem&);
  void (*bwd)(const DenseKlProblem&);
};

const SparseKlKernels& portable_sparse_kernels();
const SparseKlKernels& avx2_sparse_kernels();
const SparseKlKernels& avx512_sparse_kernels();
const SparseKlKernels& avx512_bf16_sparse_kernels();
const SparseKlKernels& amx_sparse_kernels();

const DenseKlKernels& portable_dense_kernels();
const DenseKlKernels& avx2_dense_kernels();
const DenseKlKernels& avx512_dense_kernels();
const DenseKlKernels& avx512_bf16_dense_kernels();
const DenseKlKernels& amx_dense_kernels();

// Tile shapes of the pair kernels.
inline constexpr std::int64_t kPairChunk = 32;      // bf16 elements per 64-byte tile row
inline constexpr std::int64_t kPairMaxChunks = 64;  // dense: teacher and indexer dims up to 2048

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

inline bool pair_dense_supported(const DenseKlProblem& p) {
  const auto bf = DType::bf16;
  if (p.query.dtype != bf || p.key.dtype != bf || p.index_query.dtype != bf || p.index_key.dtype != bf) return false;
  const std::int64_t drope = p.query_rope.present() ? p.query_rope.dim : 0;
  if (drope && (p.query_rope.dtype != bf || p.key_rope.dtype != bf || drope % kPairChunk)) return false;
  return p.query.dim % kPairChunk == 0 && (p.query.dim + drope) / kPairChunk <= kPairMaxChunks &&
         p.index_query.dim % kPairChunk == 0 && p.index_query.dim / kPairChunk <= kPairMaxChunks &&
         p.query.heads <= 1024;
}

}  // namespace dsa::cpu::kl_kernels
