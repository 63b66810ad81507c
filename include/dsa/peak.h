// Arithmetic peak of this machine per instruction kind, measured by dsa itself.
//
// The benchmark compares a fused kernel with the peak of the ISA it runs on.
// torch's GEMM cannot give that ceiling when dsa is capped below the CPU's
// best ISA (DSA_ISA=avx2 on an AVX-512 machine: oneDNN still uses AVX-512),
// so dsa measures each instruction kind with a short register-only loop.
#pragma once

#include <string>
#include <vector>

namespace dsa {

enum class PeakKernel : int {
  fp32_portable = 0,    // 128-bit SSE mul + add (x86-64 baseline, what portable code can use)
  fp32_fma_avx2 = 1,    // vfmadd on ymm: 8 lanes x 2 FLOP
  fp32_fma_avx512 = 2,  // vfmadd on zmm: 16 lanes x 2 FLOP
  bf16_dot_avx512 = 3,  // vdpbf16ps on zmm: 32 bf16 pair products + adds = 64 FLOP
};

// "fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512", "bf16_dot_avx512".
const char* peak_kernel_name(PeakKernel kernel);
// Throws dsa::Error (invalid_argument) for an unknown name.
PeakKernel parse_peak_kernel(const std::string& name);

// True when this CPU (and OS) can execute the kernel's instructions; DSA_ISA
// does not change it: it states what the hardware has, not what dsa picked.
bool peak_kernel_supported(PeakKernel kernel);
// Every kernel this CPU supports, in enum order.
std::vector<PeakKernel> supported_peak_kernels();

// FLOP/s of `kernel` on `num_threads` threads (0 = default_num_threads()),
// each running many independent accumulator chains in registers on dsa's
// parallel runner. Takes about `seconds` of wall time in all (a warm-up region
// and three timed ones; the best is returned). Throws dsa::Error when the CPU
// lacks the instructions or seconds is not in (0, 10].
double measure_peak_flops(PeakKernel kernel, int num_threads = 0, double seconds = 0.2);

}  // namespace dsa
