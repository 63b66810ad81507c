// AVX-512-BF16 kernels of the dense indexer KL loss (bf16 inputs) for CPUs
// without AMX: the algorithm of dense_kl_pairs.h with its products on the
// vdpbf16ps engine, reading the operands packed for AMX tiles.
#define DSA_KL_DENSE_KERNELS avx512_bf16_dense_kernels
#define DSA_KL_LABEL "avx512_bf16"
#include "cpu/dense_indexer/dense_kl_pairs.h"

#include "cpu/isa/avx512bf16_gemm.h"

namespace dsa::cpu::kl_kernels {
namespace {

using avx512bf16::as_bf16;
using avx512bf16::PairGemm;

void configure_tiles() {}  // no tile state
void release_tiles() {}

// The chunks of `a` come in runs that continue one row layout (the key's main
// dims, then its rope dims, each in its own tensor); one product per run,
// accumulating into c after the first.
void tile_gemm_32x32(const ATiles& a, const std::uint32_t* b, float* c) {
  for (int64_t first = 0; first < a.chunks;) {
    int64_t end = first + 1;
    while (end < a.chunks && a.stride[end] == a.stride[first] && a.ptr[end] == a.ptr[end - 1] + kChunk) ++end;
    const PairGemm gemm{c, kTq, 16, a.ptr[first], a.stride[first], kChunk, as_bf16(b) + first * 1024, 32, 1024, 512,
                        end - first};
    avx512bf16::gemm(first > 0, gemm, kTk, 2);
    first = end;
  }
}

void dq_flush(float* dqt, const std::uint16_t* ikt, const std::uint32_t* cvnni, int64_t iheads, int64_t idim,
              int64_t count) {
  for (int64_t j = 0; j < iheads; ++j) {
    const PairGemm gemm{dqt + j * idim * kTq, kTq, 16, ikt, kDqTiles * kTk, kTk,
                        as_bf16(cvnni) + j * kDqTiles * 1024, 32, 1024, 512, count};
    avx512bf16::gemm(true, gemm, idim, 2);
  }
}

void dk_update(float* dk, int64_t idim, const std::uint16_t* coef, const std::uint32_t* ivnni, int64_t iheads) {
  const int64_t dgroups = idim / 16;
  const PairGemm gemm{dk, idim, 16, coef, kTq, kTk * kTq, as_bf16(ivnni), 32, dgroups * 512, 512, iheads};
  avx512bf16::gemm(true, gemm, kTk, dgroups);
}

}  // namespace
}  // namespace dsa::cpu::kl_kernels
