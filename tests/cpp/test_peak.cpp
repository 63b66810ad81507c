// dsa's arithmetic peak microbenchmark (include/dsa/peak.h): which kernels a
// CPU has, that each loop really executes its instructions, and the bounds.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <string>

#include "core/cpu_features.h"
#include "dsa/error.h"
#include "dsa/peak.h"

namespace {

using dsa::PeakKernel;

// FLOP of one instruction of each kernel (a portable "instruction" is one mul + add pair).
double flop_per_instruction(PeakKernel k) {
  switch (k) {
    case PeakKernel::fp32_portable: return 8;
    case PeakKernel::fp32_fma_avx2: return 16;
    case PeakKernel::fp32_fma_avx512: return 32;
    case PeakKernel::bf16_dot_avx512: return 64;
  }
  return 0;
}

TEST(Peak, SupportedKernelsFollowTheCpuFeatures) {
  const auto& f = dsa::core::cpu_features();
  EXPECT_TRUE(dsa::peak_kernel_supported(PeakKernel::fp32_portable));
  EXPECT_EQ(dsa::peak_kernel_supported(PeakKernel::fp32_fma_avx2), f.avx2 && f.fma);
  EXPECT_EQ(dsa::peak_kernel_supported(PeakKernel::fp32_fma_avx512), f.avx512f);
  EXPECT_EQ(dsa::peak_kernel_supported(PeakKernel::bf16_dot_avx512), f.avx512f && f.avx512bf16);
  for (auto k : dsa::supported_peak_kernels()) {
    EXPECT_TRUE(dsa::peak_kernel_supported(k));
    EXPECT_EQ(dsa::parse_peak_kernel(dsa::peak_kernel_name(k)), k);
  }
}

TEST(Peak, LoopsRunTheirInstructionsWithinTheTimeAsked) {
  for (int threads : {1, 2}) {
    for (auto k : dsa::supported_peak_kernels()) {
      const auto t0 = std::chrono::steady_clock::now();
      const double flops = dsa::measure_peak_flops(k, threads, 0.1);
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_LT(wall, 1.0) << dsa::peak_kernel_name(k);
      // Above 4 instructions per cycle at 6 GHz per thread no CPU here goes: a
      // loop the compiler had dropped would read as far more (or infinite).
      EXPECT_GT(flops, 1e8) << dsa::peak_kernel_name(k);
      EXPECT_LT(flops, threads * flop_per_instruction(k) * 4 * 6e9) << dsa::peak_kernel_name(k);
    }
  }
}

TEST(Peak, BadRequestsThrow) {
  EXPECT_THROW(dsa::parse_peak_kernel("fp64_fma_avx1024"), dsa::Error);
  EXPECT_THROW(dsa::measure_peak_flops(PeakKernel::fp32_portable, 1, 0.0), dsa::Error);
  EXPECT_THROW(dsa::measure_peak_flops(PeakKernel::fp32_portable, 1, 11.0), dsa::Error);
  EXPECT_THROW(dsa::measure_peak_flops(PeakKernel::fp32_portable, 1, std::nan("")), dsa::Error);
  if (!dsa::peak_kernel_supported(PeakKernel::bf16_dot_avx512))
    EXPECT_THROW(dsa::measure_peak_flops(PeakKernel::bf16_dot_avx512, 1, 0.1), dsa::Error);
}

}  // namespace
