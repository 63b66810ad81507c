// Pooling microkernels of the fused CPU compressor, one set per ISA.
//
// A call handles one compressed entry over a run of `width` output channels:
// slot i contributes kv[i][ch] with logit gate[i][ch] + bias[i][ch]; every
// pointer is already offset to the run's first channel. Per channel: the
// maximum logit, then exp / sum / weighted sum (and in backward the
// gradients); the entry's rows stay on chip between those steps, so every
// input byte comes from memory once. fp32 arithmetic.
#pragma once

#include <cstdint>
#include <vector>

#include "dsa/tensor.h"

namespace dsa::cpu::compressor_kernels {

// Per-thread scratch whose strips start on a 64-byte boundary (aligned vector stores).
struct AlignedFloats {
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  AlignedFloats(AlignedFloats&&) = default;  // a moved vector keeps its buffer
  std::vector<float> storage;
  float* data = nullptr;
  explicit AlignedFloats(std::size_t n) : storage(n + 16) {  // never copied: `data` points into storage
    auto address = reinterpret_cast<std::uintptr_t>(storage.data());
    data = storage.data() + ((64 - address % 64) % 64) / sizeof(float);
  }
};

// Floats of scratch a call needs: one weight per slot and channel of a
// 64-channel strip (the vector kernels' unit; the portable one uses a row).
inline std::int64_t scratch_floats(std::int64_t slot_count) { return slot_count * 64; }
// Floats of one thread's forward scratch for entries of `slot_count` slots over
// `channels` channels: the many-slot forward keeps three rows of c floats (each
// padded to a 32-channel group), backward_from_stats two, and the portable kernel
// one float per slot (covered by scratch_floats).
inline std::int64_t forward_scratch_floats(std::int64_t slot_count, std::int64_t channels) {
  const std::int64_t rows = 3 * ((channels + 31) / 32 * 32);
  return scratch_floats(slot_count) > rows ? scratch_floats(slot_count) : rows;
}

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
  float* scratch;            // 64-byte aligned: scratch_floats(slot_count), and at
                             // least three rows of `width` floats, each rounded up to 32
  // The block of rows the next entry of the sequence adds (kv and gate, from
  // its first row's start, prefetch_bytes each; 0 if none): the kernels ask
  // for it in order, spread over this call. A hint, never dereferenced.
  const void* prefetch_kv;
  const void* prefetch_gate;
  std::int64_t prefetch_bytes;
  // Backward: write d kv / d gate with non-temporal stores (large outputs).
  bool stream_gradients;
  // Softmax statistics of the entry (see dsa/compressor.h) at the run's first
  // channel: rows max, 1 / sum and out, stats_stride floats apart. Forward:
  // written when not null. backward_from_stats: read.
  float* stats;
  std::int64_t stats_stride;
};

struct PoolKernel {
  const char* name;
  void (*forward)(const PoolArgs& args);
  // Writes d kv and d gate of every slot and adds d logit into bias_partial.
  void (*backward)(const PoolArgs& args);
  // The same from the saved statistics: one pass over the slots. Needs
  // scratch for two rows of `width` floats, each rounded up to 16.
  void (*backward_from_stats)(const PoolArgs& args);
};

// The kernel the fused compressor runs on this CPU (cpu/select.h): the
// compressor's and the decode compressor's one choice.
const PoolKernel& pick_pool_kernel();

const PoolKernel& portable_kernel();
const PoolKernel& avx2_kernel();         // needs AVX2, FMA and F16C
const PoolKernel& avx512_kernel();
const PoolKernel& avx512_bf16_kernel();  // needs AVX512-BF16 (Zen 4/5, Sapphire Rapids class)

// Gradients of at least this many bytes each are written with non-temporal
// stores (PoolArgs::stream_gradients): 4 MiB.
inline constexpr std::int64_t kStreamGradientBytes = std::int64_t{4} << 20;

// Tests only: stream gradients from `bytes` on instead (kStreamGradientBytes
// to go back), so that small cases take the streamed path and its aligned and
// unaligned lines run under the sanitizers in a fraction of the time.
void stream_gradients_from_bytes_for_testing(std::int64_t bytes);

}  // namespace dsa::cpu::compressor_kernels
