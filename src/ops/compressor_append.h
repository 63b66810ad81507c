// Internal: the decode compressor's problem after validation, shared by its backends.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dsa/tensor.h"

namespace dsa {

struct CompressorAppendProblem {
  DType dtype = DType::f32;  // of kv, gate, compressed
  std::int64_t ratio = 1;    // m
  bool overlap = false;
  std::int64_t channels = 0, in_channels = 0;  // c, C = (overlap ? 2 : 1) * c
  std::int64_t batch = 0, new_rows = 0;        // B, n
  const void* kv = nullptr;                    // element b * kv_batch_stride + i * kv_row_stride + ch
  const void* gate = nullptr;
  std::int64_t kv_batch_stride = 0, kv_row_stride = 0, gate_batch_stride = 0, gate_row_stride = 0;
  const float* position_bias = nullptr;  // [m, C], row stride below
  std::int64_t bias_row_stride = 0;
  float* state_kv = nullptr;    // [B, R, C] contiguous
  float* state_gate = nullptr;
  std::vector<std::int64_t> lengths, new_lens;  // [B]
  void* compressed = nullptr;   // [B, out_rows, c] contiguous
  std::int64_t out_rows = 0;    // ceil(n / m)
  int num_threads = 1;

  std::int64_t ring() const { return (overlap ? 2 : 1) * ratio; }
  // First token a request of `length` tokens still needs for its next entries.
  std::int64_t keep_from(std::int64_t length) const {
    return std::max<std::int64_t>(0, length / ratio * ratio - (overlap ? ratio : 0));
  }
  // Entries request b completes in this call: [first_entry, end_entry).
  std::int64_t first_entry(std::int64_t b) const { return lengths[b] / ratio; }
  std::int64_t end_entry(std::int64_t b) const { return (lengths[b] + new_lens[b]) / ratio; }
  float* state_row(float* state, std::int64_t b, std::int64_t token) const {
    return state + (b * ring() + token % ring()) * in_channels;
  }
};

namespace reference {
void compressor_append(const CompressorAppendProblem& problem);
}
namespace cpu {
void compressor_append(const CompressorAppendProblem& problem);
}

}  // namespace dsa
