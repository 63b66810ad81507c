// Pooling microkernels of the fused CPU compressor, one set per ISA.
//
// A call handles one compressed entry over a run of `width` output channels:
// slot i contributes kv[i][ch] with logit gate[i][ch] + bias[i][ch]; every
// pointer is already offset to the run's first channel. Channels are processed
// in strips of kStripWidth, each in one pass over the slots for the maximum and
// one for exp / sum / weighted sum (the strip's rows stay in L1/L2 between
// passes), so every input byte comes from memory once. fp32 throughout.
#pragma once

#include <cstdint>

#include "dsa/tensor.h"

namespace dsa::cpu::compressor_kernels {

inline constexpr std::int64_t kStripWidth = 64;

struct SlotRef {
  const void* kv;
  const void* gate;
  const float* bias;
  void* grad_kv;       // backward only
  void* grad_gate;     // backward only
  float* bias_partial; // backward only: this task's running d bias row
};

struct PoolArgs {
  DType dtype;
  std::int64_t slot_count;
  const SlotRef* slots;
  std::int64_t width;        // channels of this run
  void* out;                 // forward: compressed[entry] at the run's first channel
  const void* grad_out;      // backward: grad_compressed[entry] likewise
  float* scratch;            // slot_count * kStripWidth floats, 64-byte aligned
};

struct PoolKernel {
  const char* name;
  void (*forward)(const PoolArgs& args);
  // Writes d kv and d gate of every slot and adds d logit into bias_partial.
  void (*backward)(const PoolArgs& args);
};

const PoolKernel& portable_kernel();
const PoolKernel& avx512_kernel();
const PoolKernel& avx512_bf16_kernel();  // needs AVX512-BF16 (Sapphire Rapids class)

}  // namespace dsa::cpu::compressor_kernels
