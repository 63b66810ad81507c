// Register-only loops behind dsa::measure_peak_flops (include/dsa/peak.h).
//
// Each runs `iters` iterations of kPeakChains independent dependency chains
// (one instruction per chain per iteration) and returns a value computed from
// every accumulator, so the compiler cannot drop any chain. The chains hide the
// instruction latency: with latency L cycles and P pipes a core needs L * P
// chains in flight; 4-cycle FMA latency x 2 pipes (Zen 4/5, Sapphire Rapids)
// needs 8, vdpbf16ps's 6 cycles x 2 needs 12. 16 fit in the 32 zmm registers
// with the two operands; AVX2 has 16 ymm registers, so it runs 12 chains
// (enough for 2 pipes at latency <= 6, which covers the AVX2 machines here).
#pragma once

#include <cstdint>

namespace dsa::core {

constexpr int kPeakChainsAvx512 = 16;
constexpr int kPeakChainsAvx2 = 12;
constexpr int kPeakChainsPortable = 12;  // mul + add pairs on 16 xmm registers

float peak_loop_portable(std::int64_t iters);    // peak.cpp (baseline flags)
float peak_loop_fma_avx2(std::int64_t iters);    // peak_avx2.cpp
float peak_loop_fma_avx512(std::int64_t iters);  // peak_avx512.cpp
float peak_loop_dpbf16_avx512(std::int64_t iters);  // peak_avx512.cpp, target avx512bf16

}  // namespace dsa::core
