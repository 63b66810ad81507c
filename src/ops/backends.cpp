// Backend names, resolution and the self-check behind dsa.backends().
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/validate.h"
#include "dsa/backend.h"
#include "dsa/error.h"
#include "dsa/indexer.h"
#include "ops/op_table.h"

namespace dsa {

Backend parse_backend(std::string_view name) {
  if (name == "auto") return Backend::automatic;
  if (name == "reference") return Backend::reference;
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  core::fail_argument("backend: expected 'auto', 'reference', 'cpu' or 'cuda', got '", name, "'");
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::automatic: return "auto";
    case Backend::reference: return "reference";
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
  }
  return "unknown";
}

Backend resolve_backend(Backend requested, Device device) {
  if (requested == Backend::automatic) requested = device == Device::cuda ? Backend::cuda : Backend::cpu;
  if (!ops::backend_built(requested))
    core::fail_unsupported(
        "backend '", backend_name(requested), "' is not built into this dsa (it is planned; rebuild with DSA_CUDA=ON "
        "once it exists); pass backend='cpu' or backend='reference' with CPU tensors");
  if (device != Device::cpu)
    core::fail_unsupported("backend '", backend_name(requested), "' runs on CPU tensors only, got ",
                           device_name(device), " tensors; move the inputs to the CPU");
  return requested;
}

namespace {

// A tiny indexer call whose answer is known by hand: 3 keys, one query head.
std::string smoke_indexer(Backend backend) {
  float q[2] = {1.0f, 0.5f};           // [T=1, Hi=1, Di=2]
  float k[6] = {1, 0, 0, 1, 2, 2};     // [S=3, Di=2] -> scores 1, 0.5, 3
  float w[1] = {2.0f};                 // [T=1, Hi=1]
  std::int32_t idx[2] = {-7, -7};
  float sc[2] = {0, 0};
  IndexerParams p;
  p.topk = 2;
  p.cu_seqlens_q = {0, 1};
  p.cu_seqlens_k = {0, 3};
  indexer_topk(make_view(q, DType::f32, {1, 1, 2}), make_view(k, DType::f32, {3, 2}),
               make_view(w, DType::f32, {1, 1}), p, make_view(idx, DType::i32, {1, 2}),
               make_view(sc, DType::f32, {1, 2}), backend);
  if (idx[0] != 0 || idx[1] != 2 || sc[0] != 2.0f || sc[1] != 6.0f)
    return "smoke indexer call returned a wrong answer";
  return "";
}

}  // namespace

std::vector<BackendInfo> backends() {
  std::vector<BackendInfo> out;
  for (Backend b : {Backend::reference, Backend::cpu, Backend::cuda}) {
    BackendInfo info;
    info.name = backend_name(b);
    info.built = ops::backend_built(b);
    if (!info.built) {
      info.detail = "not built (CUDA kernels are planned; rebuild with DSA_CUDA=ON once they exist)";
    } else {
      try {
        std::string problem = smoke_indexer(b);
        info.works = problem.empty();
        info.detail = problem.empty() ? (b == Backend::cpu ? "isa=" + cpu_isa_name() : "literal loops")
                                      : problem;
      } catch (const std::exception& e) {
        info.detail = e.what();
      }
    }
    out.push_back(info);
  }
  return out;
}

}  // namespace dsa
