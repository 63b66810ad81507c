// CPU feature detection and the run-time ISA choice of the fused CPU backend.
#pragma once

namespace dsa::core {

// Ordered: each level has everything below it. avx512_bf16 adds vdpbf16ps
// (Zen 4/5, Cooper Lake, and every AMX CPU).
enum class Isa : int { portable = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx = 4 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false;
  bool amx_tile = false, amx_bf16 = false;
  bool amx_permitted = false;  // the kernel granted this process the AMX tile state
};

const CpuFeatures& cpu_features();

// The best ISA this machine and build support, before DSA_ISA lowers it.
Isa machine_isa();

// The best ISA this machine and build support, lowered by DSA_ISA
// (amx | avx512_bf16 | avx512 | avx2 | portable) when set; logged once under DSA_LOG=debug.
Isa cpu_isa();
const char* isa_name(Isa isa);

// Tests exercise every code path on one machine by capping the ISA (never raising it).
void limit_isa_for_testing(Isa isa);

// True when DSA_LOG=debug.
bool debug_logging();

}  // namespace dsa::core
