// The forced-ISA runs of the whole suite (tests/cpp/CMakeLists.txt: DSA_ISA=avx2 and
// DSA_ISA=avx512, so that the lower paths run on whatever CPU CI has) repeat the plain
// run test for test where the forced ISA lowers nothing: on an AVX2-only CPU both of
// them run AVX2, as the plain run does. There such a run says so and exits with the
// code ctest reads as skipped, before any test, instead of spending the suite's time
// twice more on the slowest machines it runs on. Run by hand (without
// DSA_TESTS_FORCED_ISA_RUN) the binary runs every test whatever DSA_ISA says.
#include <cstdio>
#include <cstdlib>

#include "core/cpu_features.h"

namespace {

constexpr int kSkippedExitCode = 77;  // SKIP_RETURN_CODE of the forced-ISA tests

[[maybe_unused]] const bool forced_run_checked = [] {
  const char* forced = std::getenv("DSA_TESTS_FORCED_ISA_RUN");
  if (forced == nullptr || *forced == '\0') return false;
  const dsa::core::Isa runs = dsa::core::cpu_isa();
  if (runs != dsa::core::machine_isa()) return true;
  const char* asked = std::getenv("DSA_ISA");
  std::printf("DSA_ISA=%s lowers nothing on this CPU (its best, %s, runs): the plain run covers this one; "
              "skipped\n", asked ? asked : "", dsa::core::isa_name(runs));
  std::fflush(stdout);
  std::_Exit(kSkippedExitCode);
}();

}  // namespace
