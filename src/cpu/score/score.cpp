// The lightning indexer's score kernels, chosen once per dtype for every op that
// scores index queries against index keys: the indexer's top-k, the decode
// indexer and the dense indexer's log-sum-exp.
#include "cpu/score/score_kernels.h"

#include "cpu/select.h"

namespace dsa::cpu {
namespace {

bool is_bf16(const DType& dtype) { return dtype == DType::bf16; }

// Candidates, best first (cpu/select.h): the bf16 pair kernels take bf16 only.
constexpr Candidate<indexer_kernels::ScoreKernel, DType> kScoreKernels[] = {
    {core::Isa::amx, indexer_kernels::amx_kernel, is_bf16},
    {core::Isa::avx512_bf16, indexer_kernels::avx512_bf16_kernel, is_bf16},
    {core::Isa::avx512, indexer_kernels::avx512_kernel},
    {core::Isa::avx2, indexer_kernels::avx2_kernel},
    {core::Isa::portable, indexer_kernels::portable_kernel},
};

}  // namespace

const indexer_kernels::ScoreKernel& indexer_kernels::pick_score_kernel(DType dtype) {
  return select_kernel(kScoreKernels, dtype);
}

}  // namespace dsa::cpu
