// AVX-512-BF16 attention kernels (bf16 inputs) for CPUs without AMX (Zen 4,
// Zen 5, Cooper Lake) and for AMX CPUs under DSA_ISA=avx512_bf16: the
// pair-layout algorithm of kernels_pairs.h with every product on the
// vdpbf16ps engine (cpu/isa/avx512bf16_gemm.h), which reads the operands in
// the layouts packed for AMX tiles.
#include <cstdint>

#include "cpu/isa/avx512bf16_gemm.h"

namespace dsa::cpu::attention_kernels {
namespace {

void configure_tiles() {}  // no tile state

// The dkv pass runs a sub-block densely only when the token lists all of it:
// at half the keys listed (V3.2's top-2048 of 4096) the wasted products made
// the dkv pass take 1.3-1.45x as long as pooling the listed entries.
constexpr std::int64_t kDenseSubBlockPercent = 100;

// The product contract of kernels_pairs.h ("Products") in the engine's terms:
// tile (mt, ng) of C at c + mt*16*c_stride + ng*16 is rows mt*16.. of groups of 16.
void tile_gemm2(bool accumulate, float* c, std::int64_t c_stride, std::int64_t m_tiles, std::int64_t n_groups,
                const std::uint16_t* a, std::int64_t a_stride, const std::uint16_t* b, std::int64_t b_stride,
                std::int64_t b_chunk, std::int64_t b_group, std::int64_t k_chunks, std::int64_t n2_groups,
                const std::uint16_t* a2, const std::uint16_t* b2, std::int64_t b2_stride, std::int64_t b2_chunk,
                std::int64_t k2_chunks, LineDrip* drip = nullptr) {
  const avx512bf16::PairGemm first{c, c_stride, 16, a, a_stride, 32, b, b_stride, b_chunk, b_group, k_chunks, drip};
  const avx512bf16::PairGemm second{c, c_stride, 16, a2, a_stride, 32, b2, b2_stride, b2_chunk, b_group, k2_chunks,
                                    drip};
  avx512bf16::gemm(accumulate, first, m_tiles * 16, n_groups, n2_groups > 0 ? &second : nullptr, n2_groups);
}

}  // namespace
}  // namespace dsa::cpu::attention_kernels

#define DSA_PAIR_KERNEL_NAME avx512_bf16_kernel
#define DSA_PAIR_KERNEL_LABEL "avx512_bf16"
#include "cpu/sparse_attention/kernels_pairs.h"
