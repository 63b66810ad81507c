// AVX-512-BF16 kernels of the sparse KL loss (bf16 inputs) for CPUs without
// AMX: the algorithm of kl_sparse_pairs.h with its products on the vdpbf16ps
// engine, reading the operands packed for AMX tiles.
#define DSA_KL_SPARSE_KERNELS avx512_bf16_sparse_kernels
#define DSA_KL_LABEL "avx512_bf16"
#include "cpu/kl_loss/kl_sparse_pairs.h"

#include "cpu/isa/avx512bf16_gemm.h"

namespace dsa::cpu::kl_kernels {
namespace {

using avx512bf16::PairGemm;

void configure_tiles() {}  // no tile state
void release_tiles() {}

// Both groups of a pair in one product (their C blocks 512 floats apart), then
// the epilogues in group order.
template <class Epilogue>
void block_gemm(const std::uint16_t* a, int64_t chunks, const std::uint32_t* b, int64_t groups, float* cbuf,
                const Epilogue& epilogue) {
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    const PairGemm gemm{cbuf, 16, 512, a, chunks * kChunk, kChunk, avx512bf16::as_bf16(b) + g * 512, 32, groups * 512, 512,
                        chunks};
    avx512bf16::gemm(false, gemm, kBlock, pair ? 2 : 1);
    epilogue(g, cbuf);
    if (pair) epilogue(g + 1, cbuf + 512);
  }
}

void dq_update(float* dqacc, int64_t idim, const std::uint16_t* adq, const std::uint32_t* bdq, int64_t igroups,
               int64_t dgroups) {
  const PairGemm gemm{dqacc, idim, 16, adq, 32, 32, avx512bf16::as_bf16(bdq), 32, 0, 512, 1};
  avx512bf16::gemm(true, gemm, igroups * 16, dgroups);
}

void dk_contrib(float* contrib, int64_t idim, const std::uint16_t* adk, const std::uint32_t* ih, int64_t ihc,
                int64_t dgroups) {
  const PairGemm gemm{contrib, idim, 16, adk, 32, 1024, avx512bf16::as_bf16(ih), 32, dgroups * 512, 512, ihc};
  avx512bf16::gemm(false, gemm, kBlock, dgroups);
}

}  // namespace
}  // namespace dsa::cpu::kl_kernels
