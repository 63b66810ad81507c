// Kernels of the KL losses on bf16 pairs (sparse: kl_sparse_pairs.inc, dense:
// kl_dense_pairs.inc), one set per product engine: AMX tiles (amx_*) and
// AVX-512-BF16 vdpbf16ps (avx512_bf16_*). bf16 inputs with head counts and dims
// the tile shapes divide (checked by the *_supported helpers). Call each only
// after run-time detection chose its ISA.
#pragma once

#include "ops/kl_loss.h"

namespace dsa::cpu::kl_kernels {

#define DSA_KL_PAIR_KERNELS(engine)                                 \
  bool engine##_sparse_supported(const SparseKlProblem& p);         \
  bool engine##_sparse_bwd_supported(const SparseKlBackwardProblem& p); \
  void engine##_sparse_fwd(const SparseKlProblem& p);               \
  void engine##_sparse_bwd(const SparseKlBackwardProblem& p);       \
  /* dense warm-up KL: bf16, teacher and indexer dims multiples of 32 */ \
  bool engine##_dense_supported(const DenseKlProblem& p);           \
  void engine##_dense_fwd(const DenseKlProblem& p);                 \
  void engine##_dense_bwd(const DenseKlProblem& p);

DSA_KL_PAIR_KERNELS(amx)
DSA_KL_PAIR_KERNELS(avx512_bf16)
#undef DSA_KL_PAIR_KERNELS

}  // namespace dsa::cpu::kl_kernels
