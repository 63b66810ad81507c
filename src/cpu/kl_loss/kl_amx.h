// AMX-BF16 kernels of the KL losses (sparse: kl_amx.cpp, dense: kl_dense_amx.cpp); bf16 inputs with head
// counts and dims the tile shapes divide (checked by the *_supported helpers).
#pragma once

#include "ops/kl_loss.h"

namespace dsa::cpu::kl_kernels {

bool amx_sparse_supported(const SparseKlProblem& p);
bool amx_sparse_bwd_supported(const SparseKlBackwardProblem& p);
void amx_sparse_fwd(const SparseKlProblem& p);
void amx_sparse_bwd(const SparseKlBackwardProblem& p);

// Dense warm-up KL (kl_dense_amx.cpp): bf16, teacher and indexer dims multiples of 32.
bool amx_dense_supported(const DenseKlProblem& p);
void amx_dense_fwd(const DenseKlProblem& p);
void amx_dense_bwd(const DenseKlProblem& p);

}  // namespace dsa::cpu::kl_kernels
