// AMX-BF16 kernels of the sparse KL loss (kl_amx.cpp); bf16 inputs with head
// counts and dims the tile shapes divide (checked by the *_supported helpers).
#pragma once

#include "ops/kl_loss.h"

namespace dsa::cpu::kl_kernels {

bool amx_sparse_supported(const SparseKlProblem& p);
bool amx_sparse_bwd_supported(const SparseKlBackwardProblem& p);
void amx_sparse_fwd(const SparseKlProblem& p);
void amx_sparse_bwd(const SparseKlBackwardProblem& p);

}  // namespace dsa::cpu::kl_kernels
