#include "core/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "dsa/backend.h"

namespace dsa::core {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSTATE component
constexpr int kXfeatureTileData = 18;      // AMX TILEDATA

unsigned long long xgetbv0() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12);
  const bool f16c = c & (1u << 29);
  if (!osxsave) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_ok = (xcr0 & 0x6) == 0x6;
  const bool zmm_ok = (xcr0 & 0xe6) == 0xe6;
  const bool tile_ok = (xcr0 & (3ull << 17)) == (3ull << 17);
  __cpuid_count(7, 0, a, b, c, d);
  f.fma = fma && ymm_ok;
  f.f16c = f16c && ymm_ok;
  f.avx2 = (b & (1u << 5)) && ymm_ok;
  f.avx512f = (b & (1u << 16)) && zmm_ok;
  f.avx512dq = (b & (1u << 17)) && zmm_ok;
  f.avx512bw = (b & (1u << 30)) && zmm_ok;
  f.avx512vl = (b & (1u << 31)) && zmm_ok;
  f.amx_bf16 = (d & (1u << 22)) != 0;
  f.amx_tile = (d & (1u << 24)) != 0;
  unsigned a1, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  f.avx512bf16 = (a1 & (1u << 5)) && zmm_ok;
  if (f.amx_tile && f.amx_bf16) {
    // Linux hands out the AMX register state only on request; without it the
    // first tile instruction faults. XCR0 already shows the OS supports it.
    long rc = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData);
    f.amx_permitted = rc == 0 && tile_ok;
  }
  return f;
}

Isa best_isa(const CpuFeatures& f) {
  if (f.amx_permitted && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512bf16) return Isa::amx;
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq) return f.avx512bf16 ? Isa::avx512_bf16 : Isa::avx512;
  if (f.avx2 && f.fma && f.f16c) return Isa::avx2;
  return Isa::portable;
}

Isa choose_isa() {
  Isa isa = machine_isa();
  if (const char* env = std::getenv("DSA_ISA"); env && *env) {  // empty: unset
    std::string want(env);
    Isa cap = isa;
    if (want == "portable") cap = Isa::portable;
    else if (want == "avx2") cap = Isa::avx2;
    else if (want == "avx512") cap = Isa::avx512;
    else if (want == "avx512_bf16") cap = Isa::avx512_bf16;
    else if (want == "amx") cap = Isa::amx;
    else
      // An environment variable has no caller to throw to: say it once, run the CPU's best.
      std::fprintf(stderr, "[dsa] DSA_ISA=%s: unknown (expected portable, avx2, avx512, avx512_bf16 or amx); "
                   "using %s\n", env, isa_name(isa));
    if (cap > isa)
      std::fprintf(stderr, "[dsa] DSA_ISA=%s: this CPU has %s at most; using %s\n", env, isa_name(isa),
                   isa_name(isa));
    if (cap < isa) isa = cap;  // DSA_ISA only lowers: it never enables what the CPU lacks
  }
  if (debug_logging()) std::fprintf(stderr, "[dsa] cpu backend uses ISA %s\n", isa_name(isa));
  return isa;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

Isa machine_isa() { return best_isa(cpu_features()); }

namespace {
std::atomic<int>& isa_limit() {
  static std::atomic<int> limit{static_cast<int>(Isa::amx)};
  return limit;
}
}  // namespace

Isa cpu_isa() {
  static const Isa best = choose_isa();
  const int limit = isa_limit().load(std::memory_order_relaxed);
  return static_cast<int>(best) < limit ? best : static_cast<Isa>(limit);
}

void limit_isa_for_testing(Isa isa) { isa_limit().store(static_cast<int>(isa)); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::amx: return "amx";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::portable: return "portable";
  }
  return "unknown";
}

bool debug_logging() {
  static const bool on = [] {
    const char* env = std::getenv("DSA_LOG");
    return env && std::strcmp(env, "debug") == 0;
  }();
  return on;
}

}  // namespace dsa::core

namespace dsa {
std::string cpu_isa_name() { return core::isa_name(core::cpu_isa()); }
}  // namespace dsa
