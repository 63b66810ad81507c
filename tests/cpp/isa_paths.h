// Which ISA paths a C++ test runs.
//
// The library runs min(asked, highest), where highest is the CPU's best ISA lowered
// by DSA_ISA. Asking for more than that runs the best path again under another name:
// in the plain run on a CPU without AMX every amx case repeated avx512_bf16, and in
// CI's forced-ISA runs (DSA_ISA=avx2) the avx512, avx512_bf16 and amx cases all
// repeated avx2. So an ISA-parametrised case above `highest` is skipped, saying why,
// and a loop over ISAs runs each distinct path once.
#pragma once

#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/cpu_features.h"

namespace dsa_testing {

using dsa::core::Isa;

// The highest ISA this process may run (the test cap is reset: amx means none).
inline Isa highest_isa() {
  dsa::core::limit_isa_for_testing(Isa::amx);
  return dsa::core::cpu_isa();
}

// The distinct paths that asking for each of `wanted` runs here, in order: on an
// AVX2-only CPU {avx512, avx512_bf16, amx} is {avx2}.
inline std::vector<Isa> distinct_paths(std::initializer_list<Isa> wanted = {Isa::portable, Isa::avx2, Isa::avx512,
                                                                           Isa::avx512_bf16, Isa::amx}) {
  const Isa best = highest_isa();
  std::vector<Isa> out;
  for (Isa isa : wanted) {
    const Isa runs = static_cast<int>(isa) <= static_cast<int>(best) ? isa : best;
    if (std::find(out.begin(), out.end(), runs) == out.end()) out.push_back(runs);
  }
  return out;
}

// For a case parametrised over every ISA: empty when `isa` runs as itself here, else
// why it is skipped (the `highest` case runs that path).
inline std::string skip_reason(Isa isa) {
  const Isa best = highest_isa();
  if (static_cast<int>(isa) <= static_cast<int>(best)) return {};
  return std::string(dsa::core::isa_name(isa)) + ": this process runs " + dsa::core::isa_name(best) +
         " at most (the CPU's best ISA, lowered by DSA_ISA); that case runs it";
}

// Caps the ISA for its scope, and lifts the cap on leaving it, also when an ASSERT
// returns early (the cap never raises the ISA: amx means none).
struct IsaLimit {
  explicit IsaLimit(Isa isa) { dsa::core::limit_isa_for_testing(isa); }
  ~IsaLimit() { dsa::core::limit_isa_for_testing(Isa::amx); }
  IsaLimit(const IsaLimit&) = delete;
  IsaLimit& operator=(const IsaLimit&) = delete;
};

}  // namespace dsa_testing
