#include "dsa/peak.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include "core/cpu_features.h"
#include "core/peak_kernels.h"
#include "core/thread_pool.h"
#include "dsa/error.h"

namespace dsa {
namespace core {

float peak_loop_portable(std::int64_t iters) {
  // Separate mul and add (baseline x86-64 has no FMA): two dependent
  // instructions per chain and iteration, 4 lanes x 2 FLOP per pair.
  __m128 m = _mm_set1_ps(0.999999f);
  __m128 c = _mm_set1_ps(1e-6f);
  // Opaque to the optimiser: with known constants it folds a chain that
  // starts at the loop's fixed point (1.0) away entirely.
  __asm__("" : "+x"(m), "+x"(c));
  __m128 acc[kPeakChainsPortable];
  for (int j = 0; j < kPeakChainsPortable; ++j) acc[j] = _mm_set1_ps(0.5f + 0.01f * j);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kPeakChainsPortable; ++j) acc[j] = _mm_add_ps(_mm_mul_ps(acc[j], m), c);
  }
  __m128 sum = acc[0];
  for (int j = 1; j < kPeakChainsPortable; ++j) sum = _mm_add_ps(sum, acc[j]);
  return _mm_cvtss_f32(sum);
}

}  // namespace core

namespace {

using Clock = std::chrono::steady_clock;

struct KernelInfo {
  float (*loop)(std::int64_t);
  double flops_per_iter;  // all chains of one iteration
};

KernelInfo info(PeakKernel kernel) {
  using namespace core;
  switch (kernel) {
    case PeakKernel::fp32_portable: return {peak_loop_portable, kPeakChainsPortable * 4 * 2.0};
    case PeakKernel::fp32_fma_avx2: return {peak_loop_fma_avx2, kPeakChainsAvx2 * 8 * 2.0};
    case PeakKernel::fp32_fma_avx512: return {peak_loop_fma_avx512, kPeakChainsAvx512 * 16 * 2.0};
    // One vdpbf16ps: 16 fp32 lanes, each adds two bf16 products (2 mul + 2 add).
    case PeakKernel::bf16_dot_avx512: return {peak_loop_dpbf16_avx512, kPeakChainsAvx512 * 16 * 4.0};
  }
  throw Error(ErrorKind::invalid_argument, "unknown peak kernel");
}

// FLOP/s of one parallel region in which every thread runs the loop in
// chunks until a shared deadline. Wall time of the whole region is the
// denominator, so a thread that starts late lowers the result, never raises it.
double timed_region(const KernelInfo& k, int threads, double seconds) {
  // ~1-4 us per chunk on the CPUs here: the clock is read rarely enough not
  // to matter and often enough to stop close to the deadline.
  constexpr std::int64_t kChunk = 2048;
  std::vector<std::int64_t> iters(static_cast<std::size_t>(threads), 0);
  std::atomic<float> sink{0.0f};
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  core::parallel_for(threads, threads, [&](std::int64_t task, int) {
    std::int64_t done = 0;
    float keep = 0.0f;
    while (Clock::now() < deadline) {
      keep += k.loop(kChunk);
      done += kChunk;
    }
    iters[static_cast<std::size_t>(task)] = done;
    sink.store(keep, std::memory_order_relaxed);  // the loops' results are used
  });
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  std::int64_t total = 0;
  for (auto n : iters) total += n;
  return static_cast<double>(total) * k.flops_per_iter / wall;
}

}  // namespace

const char* peak_kernel_name(PeakKernel kernel) {
  switch (kernel) {
    case PeakKernel::fp32_portable: return "fp32_portable";
    case PeakKernel::fp32_fma_avx2: return "fp32_fma_avx2";
    case PeakKernel::fp32_fma_avx512: return "fp32_fma_avx512";
    case PeakKernel::bf16_dot_avx512: return "bf16_dot_avx512";
  }
  return "unknown";
}

PeakKernel parse_peak_kernel(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(PeakKernel::bf16_dot_avx512); ++i) {
    const auto k = static_cast<PeakKernel>(i);
    if (name == peak_kernel_name(k)) return k;
  }
  throw Error(ErrorKind::invalid_argument,
              "peak kernel: expected fp32_portable, fp32_fma_avx2, fp32_fma_avx512 or bf16_dot_avx512, got '" +
                  name + "'");
}

bool peak_kernel_supported(PeakKernel kernel) {
  const auto& f = core::cpu_features();
  switch (kernel) {
    case PeakKernel::fp32_portable: return true;
    case PeakKernel::fp32_fma_avx2: return f.avx2 && f.fma;
    case PeakKernel::fp32_fma_avx512: return f.avx512f;
    case PeakKernel::bf16_dot_avx512: return f.avx512f && f.avx512bf16;
  }
  return false;
}

std::vector<PeakKernel> supported_peak_kernels() {
  std::vector<PeakKernel> out;
  for (int i = 0; i <= static_cast<int>(PeakKernel::bf16_dot_avx512); ++i)
    if (peak_kernel_supported(static_cast<PeakKernel>(i))) out.push_back(static_cast<PeakKernel>(i));
  return out;
}

double measure_peak_flops(PeakKernel kernel, int num_threads, double seconds) {
  if (!(seconds > 0.0 && seconds <= 10.0))
    throw Error(ErrorKind::invalid_argument, "measure_peak_flops: seconds must be in (0, 10]");
  if (!peak_kernel_supported(kernel))
    throw Error(ErrorKind::invalid_argument,
                std::string("measure_peak_flops: this CPU lacks the instructions of ") + peak_kernel_name(kernel));
  const KernelInfo k = info(kernel);
  const int threads = core::resolve_num_threads(num_threads);
  // A quarter of the time wakes every thread and lets the clocks settle
  // (cores may run wide vectors at a lower frequency); the best of three
  // regions is reported, so a moment of load from elsewhere lowers only one.
  timed_region(k, threads, seconds / 4);
  double best = 0.0;
  for (int trial = 0; trial < 3; ++trial) best = std::max(best, timed_region(k, threads, seconds / 4));
  return best;
}

}  // namespace dsa
