// Backends (docs/ops.md section 3). The caller chooses; dsa never falls back.
// Threads, the parallel runner and dsa's memory are in dsa/runtime.h.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "dsa/tensor.h"

namespace dsa {

enum class Backend : int { automatic, reference, cpu, cuda };

Backend parse_backend(std::string_view name);  // "auto" | "reference" | "cpu" | "cuda"
const char* backend_name(Backend backend);

// Resolves "auto" for the inputs' device and checks that the backend is built
// and can run on that device; throws dsa::Error naming the backend otherwise.
Backend resolve_backend(Backend requested, Device device);

struct BackendInfo {
  std::string name;
  bool built = false;
  bool works = false;   // a tiny smoke call ran and matched the reference
  std::string detail;   // ISA in use, or why it does not work
};

// Reports every backend dsa knows and proves each built one runs.
std::vector<BackendInfo> backends();

// The instruction set the fused CPU backend uses on this machine
// ("amx", "avx512", "avx2", "portable"); DSA_ISA may lower it for testing.
std::string cpu_isa_name();

}  // namespace dsa
