// Fused CPU KL losses (spec/ops.md 4.3, 4.4). The algorithms live in
// kl_generic.inc, compiled once per ISA (portable, AVX2, AVX-512) and picked at
// run time; each is a table of entry points.
#pragma once

#include "ops/kl_loss.h"

namespace dsa::cpu::kl_kernels {

struct KlKernels {
  const char* name;
  void (*sparse_fwd)(const SparseKlProblem&);
  void (*sparse_bwd)(const SparseKlBackwardProblem&);
  void (*dense_fwd)(const DenseKlProblem&);
  void (*dense_bwd)(const DenseKlProblem&);
};

const KlKernels& portable_kernels();
const KlKernels& avx2_kernels();
const KlKernels& avx512_kernels();

}  // namespace dsa::cpu::kl_kernels
