// Fused CPU dense-indexer KL loss (docs/ops.md 4.4, the dense warm-up): the
// kernel tables dense_indexer.cpp selects from (cpu/select.h).
// - generic (dense_kl_generic.h, compiled per ISA: portable, AVX2, AVX-512): every problem;
// - on bf16 pairs (dense_kl_pairs.h), one set per product engine: AMX tiles and
//   AVX-512-BF16 vdpbf16ps, for bf16 inputs whose dims the tile rows divide
//   (pair_dense_supported, the same for both engines).
#pragma once

#include <cstdint>

#include "cpu/isa/pair_tiles.h"
#include "ops/kl_loss.h"

namespace dsa::cpu::kl_kernels {

struct DenseKlKernels {
  const char* name;
  void (*fwd)(const DenseKlProblem&);
  void (*bwd)(const DenseKlProblem&);
};

const DenseKlKernels& portable_dense_kernels();
const DenseKlKernels& avx2_dense_kernels();
const DenseKlKernels& avx512_dense_kernels();
const DenseKlKernels& avx512_bf16_dense_kernels();
const DenseKlKernels& amx_dense_kernels();

inline constexpr std::int64_t kPairMaxChunks = 64;  // teacher and indexer dims up to 2048

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
