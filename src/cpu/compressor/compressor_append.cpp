// Fused CPU decode compressor (dsa/compressor_append.h) on the compressor's own
// pooling kernels (pool_kernels.h), so an entry is pooled by the same code, over
// the same slots in the same order, as compressor_fwd pools it.
//
// An entry whose slots are all new rows reads them in place, in their dtype:
// compressor_fwd's call exactly. One that reaches back into the state pools in
// fp32: state rows in place, new rows of a bf16 / fp16 call converted (exact)
// into a per-thread buffer, the fp32 result rounded once. For fp32 inputs both
// are compressor_fwd's bits.
//
// Tasks are fixed groups of consecutive entries (never cut by the thread
// count), each entry written by one task; the state is written only after
// every entry has read it. Any thread count gives the same bits.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/compressor/pool_kernels.h"
#include "ops/compressor_append.h"

namespace dsa::cpu {
namespace {

using namespace compressor_kernels;

// Raw tokens per task: compressor.cpp's grouping, so a prompt appended at once
// splits as compressor_fwd splits it.
constexpr std::int64_t kGroupTokens = 1024;

struct Entry {
  std::int64_t b, w;
};

std::size_t element_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

struct ThreadScratch {
  std::vector<SlotRef> slots;
  AlignedFloats floats;
  std::vector<float> rows;  // [slots][2][c]: new rows of a mixed entry, in fp32
  std::vector<float> out;   // [c]: a mixed entry's fp32 result
  ThreadScratch(std::int64_t max_slots, std::int64_t c)
      : slots(max_slots),
        floats(static_cast<std::size_t>(forward_scratch_floats(max_slots, c))),
        rows(static_cast<std::size_t>(max_slots * 2 * c)),
        out(static_cast<std::size_t>(c)) {}
};

}  // namespace

void compressor_append(const CompressorAppendProblem& p) {
  const PoolKernel& kernel = pick_pool_kernel();
  const std::size_t es = element_size(p.dtype);
  const std::int64_t m = p.ratio, c = p.channels, C = p.in_channels;
  const std::int64_t max_slots = (p.overlap ? 2 : 1) * m;
  auto out_row = [&](std::int64_t b, std::int64_t e) {
    return static_cast<char*>(p.compressed) + (b * p.out_rows + e) * c * static_cast<std::int64_t>(es);
  };

  std::vector<Entry> entries;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t first = p.first_entry(b), end = p.end_entry(b);
    // Rows past the request's count hold no entry.
    if (end - first < p.out_rows)
      std::memset(out_row(b, end - first), 0, static_cast<std::size_t>((p.out_rows - (end - first)) * c) * es);
    for (std::int64_t w = first; w < end; ++w) entries.push_back({b, w});
  }
  const std::int64_t group = std::max<std::int64_t>(1, kGroupTokens / m);
  const std::int64_t n_entries = static_cast<std::int64_t>(entries.size());
  const std::int64_t groups = (n_entries + group - 1) / group;
  const int threads = std::max(1, std::min<int>(p.num_threads, static_cast<int>(std::max<std::int64_t>(1, groups))));
  std::vector<ThreadScratch> scratch;
  scratch.reserve(threads);  // no reallocation or copy: AlignedFloats points into its own storage
  for (int t = 0; t < threads && groups > 0; ++t) scratch.emplace_back(max_slots, c);

  core::parallel_for(groups, threads, [&](std::int64_t g, int thread) {
    ThreadScratch& s = scratch[thread];
    for (std::int64_t i = g * group; i < std::min(n_entries, (g + 1) * group); ++i) {
      const std::int64_t b = entries[i].b, w = entries[i].w;
      const std::int64_t start = p.lengths[b];
      const bool has_previous = p.overlap && w > 0;
      // In place, in the call's dtype, when every slot is a new row.
      const bool direct = (has_previous ? (w - 1) * m : w * m) >= start;
      const bool convert = !direct && p.dtype != DType::f32;
      std::int64_t n = 0;
      auto add = [&](std::int64_t token, std::int64_t offset, std::int64_t j) {
        SlotRef& slot = s.slots[n];
        slot.bias = p.position_bias + j * p.bias_row_stride + offset;
        if (token < start) {
          slot.kv = p.state_row(p.state_kv, b, token) + offset;
          slot.gate = p.state_row(p.state_gate, b, token) + offset;
        } else {
          const std::int64_t row = token - start;
          const char* kv = static_cast<const char*>(p.kv) +
                           (b * p.kv_batch_stride + row * p.kv_row_stride + offset) * static_cast<std::int64_t>(es);
          const char* gate = static_cast<const char*>(p.gate) +
                             (b * p.gate_batch_stride + row * p.gate_row_stride + offset) *
                                 static_cast<std::int64_t>(es);
          if (convert) {
            float* kv32 = s.rows.data() + (2 * n) * c;
            float* gate32 = kv32 + c;
            for (std::int64_t ch = 0; ch < c; ++ch) {
              kv32[ch] = core::load_float(kv, p.dtype, ch);
              gate32[ch] = core::load_float(gate, p.dtype, ch);
            }
            slot.kv = kv32;
            slot.gate = gate32;
          } else {
            slot.kv = kv;
            slot.gate = gate;
          }
        }
        ++n;
      };
      if (has_previous)
        for (std::int64_t j = 0; j < m; ++j) add((w - 1) * m + j, 0, j);
      for (std::int64_t j = 0; j < m; ++j) add(w * m + j, p.overlap ? c : 0, j);

      PoolArgs args{};
      args.dtype = direct ? p.dtype : DType::f32;
      args.slot_count = n;
      args.slots = s.slots.data();
      args.width = c;
      args.out = convert ? static_cast<void*>(s.out.data()) : out_row(b, w - p.first_entry(b));
      args.scratch = s.floats.data;
      kernel.forward(args);
      if (convert)
        for (std::int64_t ch = 0; ch < c; ++ch)
          core::store_float(out_row(b, w - p.first_entry(b)), p.dtype, ch, s.out[ch]);
    }
  });

  // The state, after every entry has read it: the new tokens a later entry needs.
  core::parallel_for(p.batch, std::max(1, std::min<int>(p.num_threads, static_cast<int>(std::max<std::int64_t>(1, p.batch)))),
                     [&](std::int64_t b, int) {
                       const std::int64_t start = p.lengths[b], end = start + p.new_lens[b];
                       for (std::int64_t t = std::max(start, p.keep_from(end)); t < end; ++t) {
                         const std::int64_t row = t - start;
                         float* kv = p.state_row(p.state_kv, b, t);
                         float* gate = p.state_row(p.state_gate, b, t);
                         for (std::int64_t col = 0; col < C; ++col) {
                           kv[col] = core::load_float(p.kv, p.dtype, b * p.kv_batch_stride + row * p.kv_row_stride + col);
                           gate[col] =
                               core::load_float(p.gate, p.dtype, b * p.gate_batch_stride + row * p.gate_row_stride + col);
                         }
                       }
                     });
}

}  // namespace dsa::cpu
