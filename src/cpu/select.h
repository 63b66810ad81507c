// The one kernel-selection scheme of the fused CPU backend (docs/architecture.md).
//
// Each op lists its kernels as candidates, best first: the lowest ISA level a
// candidate runs on and, where it takes only some problems (bf16 inputs, head
// counts its tiles divide), a predicate. select_kernel() returns the first
// candidate the ISA in use runs whose predicate accepts the problem. The ISA in
// use is core::cpu_isa(): what this machine and build support, lowered by
// DSA_ISA or by a test; this is the only place kernels read it. The last
// candidate of every list is portable and takes every problem, so a list
// always resolves.
#pragma once

#include <cstddef>

#include "core/cpu_features.h"

namespace dsa::cpu {

template <class Kernel, class Problem>
struct Candidate {
  core::Isa isa;                                // runs on this level and above
  const Kernel& (*kernel)();
  bool (*supported)(const Problem&) = nullptr;  // null: every problem
};

template <class Kernel, class Problem, std::size_t N>
const Kernel& select_kernel(const Candidate<Kernel, Problem> (&candidates)[N], const Problem& problem) {
  static_assert(N > 0, "a candidate list ends with a portable kernel");
  const core::Isa isa = core::cpu_isa();
  for (const Candidate<Kernel, Problem>& c : candidates)
    if (c.isa <= isa && (!c.supported || c.supported(problem))) return c.kernel();
  return candidates[N - 1].kernel();  // portable: never reached unless a list forgot its last entry
}

}  // namespace dsa::cpu
