// Internal: the compressor problem after validation, shared by its backends.
#pragma once

#include <cstdint>
#include <vector>

#include "dsa/tensor.h"

namespace dsa {

struct CompressorSequence {
  std::int64_t token_begin = 0;  // first row of the flattened kv / gate
  std::int64_t length = 0;       // valid raw tokens
  std::int64_t row_extent = 0;   // rows owned (BSND: Sk, padding included; TND: length)
  std::int64_t out_begin = 0;    // first row of the flattened compressed tensor
  std::int64_t entries = 0;      // length // ratio
  std::int64_t out_extent = 0;   // rows owned (BSND: Sk // m; TND: entries)
};

struct CompressorProblem {
  DType dtype = DType::f32;  // of kv, gate, compressed, grad_* (not grad_position_bias)
  std::int64_t ratio = 1;    // m
  bool overlap = false;
  std::int64_t channels = 0;      // c, output channels
  std::int64_t in_channels = 0;   // C = (overlap ? 2 : 1) * c
  const void* kv = nullptr;       // [rows, C], unit stride in C
  const void* gate = nullptr;
  std::int64_t kv_row_stride = 0, gate_row_stride = 0;
  const float* position_bias = nullptr;  // [m, C]
  std::int64_t bias_row_stride = 0;
  std::int64_t rows = 0;      // flattened kv rows (S or B * Sk)
  std::int64_t out_rows = 0;  // flattened compressed rows
  std::vector<CompressorSequence> seqs;
  int num_threads = 1;

  // Forward output: [out_rows, c], contiguous.
  void* compressed = nullptr;
  // Backward: grad_compressed [out_rows, c] (row stride below, unit last stride);
  // grad_kv / grad_gate [rows, C] contiguous; grad_position_bias [m, C] contiguous.
  const void* grad_compressed = nullptr;
  std::int64_t grad_compressed_row_stride = 0;
  void* grad_kv = nullptr;
  void* grad_gate = nullptr;
  float* grad_position_bias = nullptr;
  // Softmax statistics [out_rows, 3, c] fp32 (see dsa/compressor.h): written
  // by a forward that has them, read by a backward that has them; may be null.
  float* stats = nullptr;
};

namespace reference {
void compressor_fwd(const CompressorProblem& problem);
void compressor_bwd(const CompressorProblem& problem);
}  // namespace reference
namespace cpu {
void compressor_fwd(const CompressorProblem& problem);
void compressor_bwd(const CompressorProblem& problem);
}  // namespace cpu

}  // namespace dsa
