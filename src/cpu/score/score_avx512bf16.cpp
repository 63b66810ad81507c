// AVX-512-BF16 score kernel of the fused indexer (bf16 inputs) for CPUs
// without AMX: the algorithm of score_pairs.h with its products on the
// vdpbf16ps engine, reading the operands packed for AMX tiles.
#include <cstdint>

#include "cpu/isa/avx512bf16_gemm.h"

namespace dsa::cpu::indexer_kernels {
namespace {

void configure_tiles() {}  // no tile state

// The product contract of score_pairs.h ("Products"): per 16-head group, a
// [16 heads] x [2 key groups] product whose groups are the tiles 256 floats apart.
inline void score_block(const std::uint16_t* a0, const std::uint16_t* a1, int q_stride, const std::uint32_t* b,
                        std::int64_t b_chunk, std::int64_t chunks, bool pair, float* cbuf) {
  avx512bf16::PairGemm g{cbuf, 16, 256, a0, q_stride / 2, 32, avx512bf16::as_bf16(b), 32,
                         b_chunk * 2, 512, chunks};
  avx512bf16::gemm(false, g, 16, 2);
  if (pair) {
    g.c = cbuf + 512;
    g.a = a1;
    avx512bf16::gemm(false, g, 16, 2);
  }
}

}  // namespace
}  // namespace dsa::cpu::indexer_kernels

#define DSA_SCORE_KERNEL_NAME avx512_bf16_kernel
#define DSA_SCORE_KERNEL_LABEL "avx512_bf16"
#include "cpu/score/score_pairs.h"
