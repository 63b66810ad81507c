// Fused CPU sparse KL loss (spec 4.3): kernel selection. The dense indexer's
// log-sum-exp and KL are cpu/dense_indexer/.
#include "cpu/kl_loss/kl_kernels.h"
#include "cpu/select.h"

namespace dsa::cpu {
namespace {

using namespace kl_kernels;
using core::Isa;

// Candidates, best first (cpu/select.h): for bf16 the pair kernels with AMX
// tiles (kl_amx.cpp) or the same kernels on vdpbf16ps (kl_avx512bf16.cpp), for
// the problems their tiles take; otherwise the generic ones.
constexpr Candidate<SparseKlKernels, SparseKlProblem> kSparseFwd[] = {
    {Isa::amx, amx_sparse_kernels, pair_sparse_fwd_supported},
    {Isa::avx512_bf16, avx512_bf16_sparse_kernels, pair_sparse_fwd_supported},
    {Isa::avx512, avx512_sparse_kernels},
    {Isa::avx2, avx2_sparse_kernels},
    {Isa::portable, portable_sparse_kernels},
};
constexpr Candidate<SparseKlKernels, SparseKlBackwardProblem> kSparseBwd[] = {
    {Isa::amx, amx_sparse_kernels, pair_sparse_bwd_supported},
    {Isa::avx512_bf16, avx512_bf16_sparse_kernels, pair_sparse_bwd_supported},
    {Isa::avx512, avx512_sparse_kernels},
    {Isa::avx2, avx2_sparse_kernels},
    {Isa::portable, portable_sparse_kernels},
};

}  // namespace

void kl_loss_fwd(const SparseKlProblem& p) { select_kernel(kSparseFwd, p).fwd(p); }
void kl_loss_bwd(const SparseKlBackwardProblem& p) { select_kernel(kSparseBwd, p).bwd(p); }

}  // namespace dsa::cpu
