// Fused CPU KV compressor (docs/ops.md 4.5): one streaming pass per block.
//
// Work is split into tasks of consecutive compressed entries (whole rows, so
// a task streams contiguous memory, which the hardware prefetchers follow).
// The groups are cut from the flattened list of entries of all sequences with
// a fixed size (kGroupTokens raw tokens), never from the thread count, and
// every output element is written by exactly one task with the slots visited
// in a fixed order; the backward's position_bias gradient is summed per group
// and then over groups in group order. So any thread count gives the same
// bits. Scratch is one 64-channel strip of softmax weights per thread plus
// one [m, C] fp32 partial per group.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdint>
#include <vector>

#include "core/memory.h"
#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/compressor/pool_kernels.h"
#include "cpu/select.h"
#include "ops/compressor.h"

namespace dsa::cpu {
namespace {

using namespace compressor_kernels;

// Raw tokens per task group: large enough that the per-group bias partials
// stay small next to the tensors (m * C fp32 per group), small enough to give
// a 16k-token call 16 tasks.
constexpr std::int64_t kGroupTokens = 1024;
// Gradients of kStreamGradientBytes and more are streamed past the caches:
// far more than L2 holds, so a cached store would first read each line in
// (read-for-ownership) only to evict it again before anyone reads it.
std::atomic<std::int64_t>& stream_gradient_bytes() {
  static std::atomic<std::int64_t> bytes{kStreamGradientBytes};
  return bytes;
}

// Candidates, best first (cpu/select.h); every pool kernel takes every problem.
constexpr Candidate<PoolKernel, CompressorProblem> kPoolKernels[] = {
    {core::Isa::avx512_bf16, avx512_bf16_kernel},
    {core::Isa::avx512, avx512_kernel},
    {core::Isa::avx2, avx2_kernel},
    {core::Isa::portable, portable_kernel},
};

struct Entry {
  std::int64_t token_row;  // first token of the entry's own block
  std::int64_t out_row;
  bool has_previous;       // overlap: block w-1 exists (w > 0)
  bool last;               // last entry of its sequence
};

struct Tasks {
  std::vector<Entry> entries;
  std::int64_t group_size = 1;  // entries per group
  std::int64_t groups = 0;
};

Tasks plan_tasks(const CompressorProblem& p) {
  Tasks t;
  for (const CompressorSequence& s : p.seqs)
    for (std::int64_t w = 0; w < s.entries; ++w)
      t.entries.push_back({s.token_begin + w * p.ratio, s.out_begin + w, w > 0, w + 1 == s.entries});
  t.group_size = std::max<std::int64_t>(1, kGroupTokens / p.ratio);
  const std::int64_t n = static_cast<std::int64_t>(t.entries.size());
  t.groups = (n + t.group_size - 1) / t.group_size;
  return t;
}

std::size_t element_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

template <class T>
const T* at(const void* base, std::int64_t elements, std::size_t esize) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + elements * static_cast<std::int64_t>(esize));
}
template <class T>
T* at(void* base, std::int64_t elements, std::size_t esize) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + elements * static_cast<std::int64_t>(esize));
}

// Fills the slots of entry e (spec order: with overlap, block w-1 on [0, c)
// then block w on [c, 2c)).
std::int64_t fill_slots(const CompressorProblem& p, const Entry& e, bool backward, float* bias_partial,
                        SlotRef* slots) {
  const std::size_t es = element_size(p.dtype);
  const std::int64_t m = p.ratio, C = p.in_channels;
  std::int64_t n = 0;
  auto add = [&](std::int64_t row, std::int64_t offset, std::int64_t j) {
    const std::int64_t col = offset;
    SlotRef& s = slots[n++];
    s.kv = at<void>(p.kv, row * p.kv_row_stride + col, es);
    s.gate = at<void>(p.gate, row * p.gate_row_stride + col, es);
    s.bias = p.position_bias + j * p.bias_row_stride + col;
    if (backward) {
      s.grad_kv = at<void>(p.grad_kv, row * C + col, es);
      s.grad_gate = at<void>(p.grad_gate, row * C + col, es);
      s.bias_partial = bias_partial + j * C + col;
    }
  };
  if (p.overlap && e.has_previous)
    for (std::int64_t j = 0; j < m; ++j) add(e.token_row - m + j, 0, j);
  for (std::int64_t j = 0; j < m; ++j) add(e.token_row + j, p.overlap ? p.channels : 0, j);
  return n;
}

// The rows entry e + 1 of the sequence adds (block w + 1), for the kernels to
// prefetch while they work on entry e: whole rows, one stride apart, so one
// byte count serves kv and gate only when their strides agree.
void set_prefetch(const CompressorProblem& p, const Entry& e, PoolArgs& args) {
  args.prefetch_bytes = 0;
  if (e.last || p.kv_row_stride != p.gate_row_stride) return;
  const std::size_t es = element_size(p.dtype);
  const std::int64_t row = e.token_row + p.ratio;
  args.prefetch_kv = at<const void>(p.kv, row * p.kv_row_stride, es);
  args.prefetch_gate = at<const void>(p.gate, row * p.gate_row_stride, es);
  args.prefetch_bytes = p.ratio * p.kv_row_stride * static_cast<std::int64_t>(es);
}

// Per-thread slot list and aligned float scratch of the forward and backward.
struct ThreadScratch {
  std::vector<std::vector<SlotRef>> slots;
  std::vector<AlignedFloats> floats;
  explicit ThreadScratch(const CompressorProblem& p) {
    const std::int64_t max_slots = (p.overlap ? 2 : 1) * p.ratio;
    slots.assign(p.num_threads, std::vector<SlotRef>(max_slots));
    floats.reserve(p.num_threads);  // no reallocation: `data` points into each element
    const std::int64_t floats_each = forward_scratch_floats(max_slots, p.channels);
    for (int i = 0; i < p.num_threads; ++i) floats.emplace_back(floats_each);
  }
};

}  // namespace

namespace compressor_kernels {
const PoolKernel& pick_pool_kernel() { return select_kernel(kPoolKernels, CompressorProblem{}); }
void stream_gradients_from_bytes_for_testing(std::int64_t bytes) { stream_gradient_bytes().store(bytes); }
}  // namespace compressor_kernels

void compressor_fwd(const CompressorProblem& p) {
  const PoolKernel& kernel = pick_pool_kernel();
  const std::size_t es = element_size(p.dtype);
  const std::int64_t c = p.channels;
  // BSND rows past a row's count hold no entry.
  for (const CompressorSequence& s : p.seqs)
    if (s.out_extent > s.entries) {
      std::memset(at<void>(p.compressed, (s.out_begin + s.entries) * c, es), 0,
                  static_cast<std::size_t>((s.out_extent - s.entries) * c) * es);
      if (p.stats)
        std::fill_n(p.stats + (s.out_begin + s.entries) * 3 * c, (s.out_extent - s.entries) * 3 * c, 0.0f);
    }
  const Tasks t = plan_tasks(p);
  if (t.entries.empty() || c == 0) return;
  ThreadScratch scratch(p);
  core::parallel_for(t.groups, p.num_threads, [&](std::int64_t group, int thread) {
    const std::int64_t first = group * t.group_size;
    const std::int64_t last = std::min<std::int64_t>(first + t.group_size, t.entries.size());
    SlotRef* slots = scratch.slots[thread].data();
    for (std::int64_t i = first; i < last; ++i) {
      const Entry& e = t.entries[i];
      PoolArgs args{};
      args.dtype = p.dtype;
      args.slot_count = fill_slots(p, e, false, nullptr, slots);
      args.slots = slots;
      args.width = c;
      args.out = at<void>(p.compressed, e.out_row * c, es);
      args.stats = p.stats ? p.stats + e.out_row * 3 * c : nullptr;
      args.stats_stride = c;
      args.scratch = scratch.floats[thread].data;
      set_prefetch(p, e, args);
      kernel.forward(args);
    }
  });
}

void compressor_bwd(const CompressorProblem& p) {
  const PoolKernel& kernel = pick_pool_kernel();
  const std::size_t es = element_size(p.dtype);
  const std::int64_t c = p.channels, C = p.in_channels, m = p.ratio;
  core::advise_huge_pages(p.grad_kv, static_cast<std::size_t>(p.rows * C) * es);
  core::advise_huge_pages(p.grad_gate, static_cast<std::size_t>(p.rows * C) * es);
  // Tokens outside every full block (dropped tails, BSND padding) get 0.
  for (const CompressorSequence& s : p.seqs) {
    const std::int64_t begin = s.token_begin + s.entries * m, end = s.token_begin + s.row_extent;
    if (end > begin) {
      const std::size_t bytes = static_cast<std::size_t>((end - begin) * C) * es;
      std::memset(at<void>(p.grad_kv, begin * C, es), 0, bytes);
      std::memset(at<void>(p.grad_gate, begin * C, es), 0, bytes);
    }
  }
  const Tasks t = plan_tasks(p);
  if (t.entries.empty() || c == 0) {
    std::fill(p.grad_position_bias, p.grad_position_bias + m * C, 0.0f);
    return;
  }
  // Each task zeroes its own group's partial: no up-front fill.
  const core::ScratchBuffer partial_bytes(static_cast<std::size_t>(t.groups * m * C) * sizeof(float));
  float* const partials = reinterpret_cast<float*>(partial_bytes.data());
  const bool stream =
      p.rows * C * static_cast<std::int64_t>(es) >= stream_gradient_bytes().load(std::memory_order_relaxed);
  ThreadScratch scratch(p);

  core::parallel_for(t.groups, p.num_threads, [&](std::int64_t group, int thread) {
    const std::int64_t first = group * t.group_size;
    const std::int64_t last = std::min<std::int64_t>(first + t.group_size, t.entries.size());
    float* partial = partials + group * m * C;
    std::fill_n(partial, m * C, 0.0f);
    SlotRef* slots = scratch.slots[thread].data();
    for (std::int64_t i = first; i < last; ++i) {
      const Entry& e = t.entries[i];
      PoolArgs args{};
      args.dtype = p.dtype;
      args.slot_count = fill_slots(p, e, true, partial, slots);
      args.slots = slots;
      args.width = c;
      args.grad_out = at<const void>(p.grad_compressed, e.out_row * p.grad_compressed_row_stride, es);
      args.scratch = scratch.floats[thread].data;
      set_prefetch(p, e, args);
      args.stream_gradients = stream;
      if (p.stats) {
        args.stats = p.stats + e.out_row * 3 * c;
        args.stats_stride = c;
        kernel.backward_from_stats(args);
      } else {
        kernel.backward(args);
      }
      // The [0, c) half of a sequence's last block feeds no entry.
      if (p.overlap && e.last)
        for (std::int64_t j = 0; j < m; ++j) {
          const std::int64_t row = e.token_row + j;
          std::memset(at<void>(p.grad_kv, row * C, es), 0, static_cast<std::size_t>(c) * es);
          std::memset(at<void>(p.grad_gate, row * C, es), 0, static_cast<std::size_t>(c) * es);
        }
    }
  });
  // Sum the group partials in group order (rows of the bias split over threads).
  core::parallel_for(m, p.num_threads, [&](std::int64_t j, int) {
    float* out = p.grad_position_bias + j * C;
    std::fill_n(out, C, 0.0f);
    for (std::int64_t g = 0; g < t.groups; ++g) {
      const float* src = partials + (g * m + j) * C;
      for (std::int64_t col = 0; col < C; ++col) out[col] += src[col];
    }
  });
}

}  // namespace dsa::cpu
