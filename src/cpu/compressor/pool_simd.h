// The vector pooling kernels, written once over a small vector layer and
// compiled per ISA: pool_avx512.h (16-lane zmm with k-masks, included by
// pool_avx512.cpp and pool_avx512bf16.cpp) and pool_avx2.cpp (8-lane ymm).
// fp32 arithmetic: few slots in registers, many slots row by row (forward and
// backward from statistics) or in 32- or 64-channel strips with register
// accumulators (backward without statistics).
//
// The including file defines, inside dsa::cpu::compressor_kernels::{anon},
// before including this file:
//   Vec, kLanes, vset / vzero / vadd / vsub / vmul / vmax / vfma (cpu/isa/fma.h)
//   Lane                 which lanes of one vector hold channels of the run
//   lane_mask(n)         the first n lanes (none for n <= 0)
//   WholeLane, whole_lane(): all lanes; a type of its own where whole vectors
//                        take other instructions than masked ones (AVX2), so
//                        a row's whole groups compile without any tail code
//   load<T>(base, at, lane), loadf(p, lane), storef(p, lane, v): elements of
//                        the storage dtype T / fp32, for either lane type;
//                        masked lanes read as 0 and are neither read nor
//                        written in memory
//   load_scratch(p), store_scratch(p, v): aligned fp32 vectors of scratch
//   store_group<T>(base, at, v, mask, stream, nan): the kGroup vectors of a
//                        32-channel group (one 64-byte line of bf16 / fp16),
//                        non-temporal with `stream` where the line is whole
//                        and aligned; `nan` from has_nan<T>
//   has_nan<T>(v):       whether storing group v as T must mend NaN lanes
//                        (false where the conversion keeps NaN itself)
//   Pow2, split_exp2(t), scale_exp2(p, s): t = n + f, f in [0, 1), and
//                        p * 2^n (see exp2_nonpositive)
//   safe_max(v), safe_reciprocal(v)
//   kBackwardStrip: channels per strip of the many-slot backward without
//                        statistics (32 or 64), chosen for the ISA's register count
//   kRowBlock:           rows per block of the many-slot forward (rows_forward)
//   DSA_POOL_GROUP_ATTRIBUTES: attributes of the per-group lambdas of
//                        run_in_registers / run_from_stats (inlining, which
//                        GCC decides differently per ISA; see the layers)
#include <array>
#include <cstring>
#include <type_traits>

#include "cpu/compressor/pool_kernels.h"

namespace dsa::cpu::compressor_kernels {
namespace {

// Vectors per 32-channel group: a group is one 64-byte line of a bf16 / fp16
// row, the unit the gradients are written (and streamed) in.
constexpr int kGroup = 32 / kLanes;
static_assert(kGroup * kLanes == 32, "a group is 32 channels");

// The lanes of a group's vectors: all of them (WholeLane), or the first n
// channels (Lane).
template <class L>
using Mask = std::array<L, kGroup>;

inline Mask<Lane> tail_mask(std::int64_t n) {
  Mask<Lane> mask;
  for (int h = 0; h < kGroup; ++h) mask[h] = lane_mask(n - kLanes * h);
  return mask;
}

inline Mask<WholeLane> whole_mask() {
  Mask<WholeLane> mask;
  mask.fill(whole_lane());
  return mask;
}

// Calls body(at, mask) for each 32-channel group of [0, width): the whole
// groups with whole_mask(), the last partial one with tail_mask().
template <class Body>
inline void for_each_group(std::int64_t width, Body&& body) {
  std::int64_t at = 0;
  for (; at + 32 <= width; at += 32) body(at, whole_mask());
  if (at < width) body(at, tail_mask(width - at));
}

// exp(x) for x <= 0 (and NaN) as 2^t, t = x log2(e): 2^floor(t) times 2^f,
// f = t - floor(t) in [0, 1) (the layer's split_exp2 / scale_exp2), by a
// polynomial fitted for relative error: degree 5 (1.8e-7 in fp32) for fp32
// data, degree 4 (2.7e-6) when the data are bf16 / fp16, whose own rounding
// is 4e-3 / 5e-4. Fewer vector operations than the classic Cody-Waite form:
// these kernels are bound by vector throughput once the data are on chip.
// -inf and very negative t give 0, NaN stays NaN.
template <DType T>
inline Vec exp2_nonpositive(Vec t) {
  const Pow2 s = split_exp2(t);
  Vec p;
  if constexpr (kCenteredExpSplit && T == DType::f32) {  // f in [-1/2, 1/2]: 2.1e-7
    p = vset(0.00132764725f);
    p = vfma(p, s.f, vset(0.00967554096f));
    p = vfma(p, s.f, vset(0.0555071309f));
    p = vfma(p, s.f, vset(0.240221202f));
    p = vfma(p, s.f, vset(0.693146944f));
    p = vfma(p, s.f, vset(1.00000012f));
  } else if constexpr (kCenteredExpSplit) {  // 2.7e-6
    p = vset(0.00957010221f);
    p = vfma(p, s.f, vset(0.0559178591f));
    p = vfma(p, s.f, vset(0.240247443f));
    p = vfma(p, s.f, vset(0.693121791f));
    p = vfma(p, s.f, vset(0.999999285f));
  } else if constexpr (T == DType::f32) {
    p = vset(0.0018775046f);
    p = vfma(p, s.f, vset(0.008989273f));
    p = vfma(p, s.f, vset(0.055826634f));
    p = vfma(p, s.f, vset(0.24015339f));
    p = vfma(p, s.f, vset(0.69315314f));
    p = vfma(p, s.f, vset(0.99999994f));
  } else {
    p = vset(0.013534142f);
    p = vfma(p, s.f, vset(0.052011453f));
    p = vfma(p, s.f, vset(0.24144281f));
    p = vfma(p, s.f, vset(0.69300383f));
    p = vfma(p, s.f, vset(1.0000026f));
  }
  return scale_exp2(p, s);
}

// A softmax weight's exponent is (l - max) log2(e). It is formed as one fma,
// l log2(e) + shift with shift = -max log2(e) computed once per channel
// (exp_shift), instead of a subtraction and a multiply per slot: one rounding
// instead of two, and the rounding of `shift` is the same for every slot of
// the channel, so it scales all its weights alike and cancels in the
// normalised softmax. (|max| above ~2.3e38 would overflow the shift.)
inline Vec exp_shift(Vec max) { return vmul(max, vset(-1.44269504088896341f)); }

template <DType T>
inline Vec softmax_exp(Vec logit, Vec shift) {
  return exp2_nonpositive<T>(vfma(logit, vset(1.44269504088896341f), shift));
}

template <DType T, class L>
inline Vec logit(const SlotRef& s, std::int64_t at, L mask) {
  return vadd(load<T>(s.gate, at, mask), loadf(s.bias + at, mask));
}

// Gradients of one slot over a 32-channel group:
//   d kv_i = p_i g,  d logit_i = p_i g (kv_i - out),
// with d logit also summed into the slot's bias partial. `p` is exp(logit_i -
// max), `kv` the slot's kv values, `g_inv` = g / sum.
template <DType T, class L>
inline void slot_gradients(const SlotRef& s, std::int64_t at, const Mask<L>& mask, const Vec (&p)[kGroup],
                           const Vec (&kv)[kGroup], const Vec (&out)[kGroup], const Vec (&g_inv)[kGroup],
                           bool stream) {
  Vec pg[kGroup], grad_logit[kGroup];
  for (int h = 0; h < kGroup; ++h) {
    pg[h] = vmul(p[h], g_inv[h]);
    grad_logit[h] = vmul(pg[h], vsub(kv[h], out[h]));
    float* partial = s.bias_partial + at + kLanes * h;
    storef(partial, mask[h], vadd(loadf(partial, mask[h]), grad_logit[h]));
  }
  // d logit = p g (kv - out) is NaN in every lane d kv = p g is, so its check
  // serves both stores: one compare per two vectors fewer (backward from
  // statistics, one thread on chip: see docs/compressor.md).
  const bool nan = has_nan<T>(grad_logit);
  store_group<T>(s.grad_kv, at, pg, mask, stream, nan);
  store_group<T>(s.grad_gate, at, grad_logit, mask, stream, nan);
}

// Walks the next entry's new block (PoolArgs::prefetch_*) line by line in
// address order, a fixed share per step of this call, so it is on chip when
// that entry starts: one entry ahead hides memory latency and stays within
// L2, and an ascending stream of requests is what the L2 streamer extends.
class BlockPrefetch {
 public:
  BlockPrefetch(const PoolArgs& a, std::int64_t steps)
      : kv_(static_cast<const char*>(a.prefetch_kv)), gate_(static_cast<const char*>(a.prefetch_gate)),
        end_(a.prefetch_bytes), per_step_(steps > 0 ? ((a.prefetch_bytes + 63) / 64 + steps - 1) / steps * 64 : 0) {}
  void step() {
    const std::int64_t stop = next_ + per_step_ < end_ ? next_ + per_step_ : end_;
    for (; next_ < stop; next_ += 64) {
      _mm_prefetch(gate_ + next_, _MM_HINT_T0);
      _mm_prefetch(kv_ + next_, _MM_HINT_T0);
    }
  }

 private:
  const char* kv_;
  const char* gate_;
  std::int64_t next_ = 0, end_, per_step_;
};

// One row of the forward's softmax statistics (PoolArgs::stats: 0 max,
// 1 1 / sum, 2 out) over the 32-channel group at `at`.
template <class L>
inline void store_stats_row(const PoolArgs& a, int row, std::int64_t at, const Mask<L>& mask,
                            const Vec (&v)[kGroup]) {
  for (int h = 0; h < kGroup; ++h) storef(a.stats + row * a.stats_stride + at + kLanes * h, mask[h], v[h]);
}

// Few slots (CSA: 2m = 8, or m = 4 for a sequence's first entry): one pass per
// 32 channels with every slot's logits and weights held in registers (with
// 16 ymm registers, partly in the stack frame: still L1, and still one load
// of each input byte from memory), nothing through scratch; a group of 32
// channels is one cache line of each bf16 gradient row.
template <DType T, int S, bool Backward>
void run_in_registers(const PoolArgs& a) {
  const void* kv[S];
  const void* gate[S];
  const float* bias[S];
  BlockPrefetch prefetch(a, (a.width + 31) / 32);
  for (int i = 0; i < S; ++i) {
    kv[i] = a.slots[i].kv;
    gate[i] = a.slots[i].gate;
    bias[i] = a.slots[i].bias;
  }
  for_each_group(a.width, [&](std::int64_t at, const auto& mask) DSA_POOL_GROUP_ATTRIBUTES {
    prefetch.step();
    // Maxima, sums and weighted sums as pairwise trees, not chains over the
    // slots: shorter dependency chains let more of the next group overlap this.
    Vec e[S][kGroup], kv_values[S][kGroup], out[kGroup], inv[kGroup], max_h[kGroup];
    // One vector's trees at a time, not the group's vectors unrolled and
    // interleaved: fewer values live at once (one thread, CSA: AVX-512 forward
    // 3.5 -> 2.8 ms, backward 7.1 -> 6.5 ms; AVX2 forward 5.7 -> 5.2 ms,
    // backward the same within noise). Same bits.
#pragma GCC unroll 1
    for (int h = 0; h < kGroup; ++h) {
      const std::int64_t ch = at + kLanes * h;
      Vec tree[S];
      for (int i = 0; i < S; ++i) {
        e[i][h] = vadd(load<T>(gate[i], ch, mask[h]), loadf(bias[i] + ch, mask[h]));
        tree[i] = e[i][h];
      }
      for (int width = S / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; ++i) tree[i] = vmax(tree[i], tree[i + width]);
      max_h[h] = safe_max(tree[0]);
      const Vec shift = exp_shift(max_h[h]);
      Vec sum[S], acc[S];
      for (int i = 0; i < S; ++i) {
        e[i][h] = softmax_exp<T>(e[i][h], shift);
        kv_values[i][h] = load<T>(kv[i], ch, mask[h]);
        sum[i] = e[i][h];
        acc[i] = vmul(e[i][h], kv_values[i][h]);
      }
      for (int width = S / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; ++i) {
          sum[i] = vadd(sum[i], sum[i + width]);
          acc[i] = vadd(acc[i], acc[i + width]);
        }
      inv[h] = safe_reciprocal(sum[0]);
      out[h] = vmul(acc[0], inv[h]);
    }
    if constexpr (!Backward) {
      store_group<T>(a.out, at, out, mask, false, has_nan<T>(out));
      if (a.stats) {
        store_stats_row(a, 0, at, mask, max_h);
        store_stats_row(a, 1, at, mask, inv);
        store_stats_row(a, 2, at, mask, out);
      }
    } else {
      Vec g_inv[kGroup];
      for (int h = 0; h < kGroup; ++h) g_inv[h] = vmul(load<T>(a.grad_out, at + kLanes * h, mask[h]), inv[h]);
      for (int i = 0; i < S; ++i)
        slot_gradients<T>(a.slots[i], at, mask, e[i], kv_values[i], out, g_inv, a.stream_gradients);
    }
  });
}

// Backward without statistics for any slot count (the many-slot forward is
// rows_forward below; with statistics the backward is run_from_stats):
// strips of NP 32-channel groups with register accumulators and the strip's
// weights in scratch (one row of 64 floats per slot, L1-sized for m = 128): a
// max pass, an exp / sum / weighted-sum pass that writes exp(logit - max)
// there, and a gradient pass that reads those weights back. The slots' rows
// come from memory once per pass they are needed in, and a strip of them
// stays in L1/L2 in between. While walking the rows the max pass asks for the
// same lines of the next entry.
template <DType T, int NP, class L>
void strip_backward(const PoolArgs& a, std::int64_t c0, const Mask<L> (&mask)[2], BlockPrefetch& prefetch) {
  Vec max[NP][kGroup], sum[NP][kGroup], acc[NP][kGroup];
  for (int q = 0; q < NP; ++q)
    for (int h = 0; h < kGroup; ++h) {
      max[q][h] = vset(-__builtin_inff());
      sum[q][h] = vzero();
      acc[q][h] = vzero();
    }
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    prefetch.step();
    for (int q = 0; q < NP; ++q)
      for (int h = 0; h < kGroup; ++h) {
        const std::int64_t at = c0 + 32 * q + kLanes * h;
        max[q][h] = vmax(max[q][h], logit<T>(a.slots[i], at, mask[q][h]));
      }
  }
  // From here on max holds each channel's exp_shift.
  for (int q = 0; q < NP; ++q)
    for (int h = 0; h < kGroup; ++h) max[q][h] = exp_shift(safe_max(max[q][h]));
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const SlotRef& s = a.slots[i];
    float* row = a.scratch + i * 64;
    for (int q = 0; q < NP; ++q)
      for (int h = 0; h < kGroup; ++h) {
        const std::int64_t at = c0 + 32 * q + kLanes * h;
        const Vec e = softmax_exp<T>(logit<T>(s, at, mask[q][h]), max[q][h]);
        store_scratch(row + 32 * q + kLanes * h, e);
        sum[q][h] = vadd(sum[q][h], e);
        acc[q][h] = vfma(e, load<T>(s.kv, at, mask[q][h]), acc[q][h]);
      }
  }
  Vec out[NP][kGroup], g_inv[NP][kGroup];
  for (int q = 0; q < NP; ++q)
    for (int h = 0; h < kGroup; ++h) {
      const Vec inv = safe_reciprocal(sum[q][h]);
      out[q][h] = vmul(acc[q][h], inv);
      g_inv[q][h] = vmul(load<T>(a.grad_out, c0 + 32 * q + kLanes * h, mask[q][h]), inv);
    }
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const float* row = a.scratch + i * 64;
    const SlotRef& s = a.slots[i];
    for (int q = 0; q < NP; ++q) {
      const std::int64_t at = c0 + 32 * q;
      Vec p[kGroup], kv[kGroup];
      for (int h = 0; h < kGroup; ++h) {
        p[h] = load_scratch(row + 32 * q + kLanes * h);
        kv[h] = load<T>(s.kv, at + kLanes * h, mask[q][h]);
      }
      slot_gradients<T>(s, at, mask[q], p, kv, out[q], g_inv[q], a.stream_gradients);
    }
  }
}

// Forward for many slots (HCA: m = 128), row by row: the entry's rows are
// walked front to back twice, as the backward from statistics walks them (the
// order the hardware prefetchers follow), instead of in 32-channel strips,
// whose column walks through rows 1-2 KiB apart read at about half the
// backward's bandwidth. The first pass takes each channel's maximum logit, the
// second exp / sum / weighted sum, re-reading gate (from L2) rather than
// keeping 4-byte logits. Per channel the running max, sum and weighted sum live
// in three scratch rows (L1), loaded and stored once per block of kRowBlock
// rows (a layer constant). Every slot enters each channel's max, sum and fma
// chain in slot order, as in the 32-channel strips this replaced: the same bits,
// whatever the block.

// Calls rows(R, i, at, mask) for each 32-channel group of each block of rows
// [i, i + R), R a std::integral_constant: blocks of kRowBlock, then the last
// rows one at a time. One prefetch step per group and block.
template <class Rows>
inline void for_row_blocks(const PoolArgs& a, BlockPrefetch& prefetch, Rows&& rows) {
  for (std::int64_t i = 0; i < a.slot_count; i += kRowBlock)
    for_each_group(a.width, [&](std::int64_t at, const auto& mask) {
      prefetch.step();
      if (a.slot_count - i >= kRowBlock) {
        rows(std::integral_constant<int, kRowBlock>{}, i, at, mask);
      } else {
        for (std::int64_t r = i; r < a.slot_count; ++r) rows(std::integral_constant<int, 1>{}, r, at, mask);
      }
    });
}

template <DType T, int R, class L>
inline void max_rows(const SlotRef* s, std::int64_t at, const Mask<L>& mask, bool first, float* max_row) {
  for (int h = 0; h < kGroup; ++h) {
    const std::int64_t ch = at + kLanes * h;
    Vec m = first ? vset(-__builtin_inff()) : load_scratch(max_row + ch);
    for (int r = 0; r < R; ++r) m = vmax(m, logit<T>(s[r], ch, mask[h]));
    store_scratch(max_row + ch, m);
  }
}

template <DType T, int R, class L>
inline void pool_rows(const SlotRef* s, std::int64_t at, const Mask<L>& mask, bool first, const float* shift_row,
                      float* sum_row, float* acc_row) {
  for (int h = 0; h < kGroup; ++h) {
    const std::int64_t ch = at + kLanes * h;
    const Vec shift = load_scratch(shift_row + ch);
    Vec sum = first ? vzero() : load_scratch(sum_row + ch), acc = first ? vzero() : load_scratch(acc_row + ch);
    for (int r = 0; r < R; ++r) {
      const Vec e = softmax_exp<T>(logit<T>(s[r], ch, mask[h]), shift);
      sum = vadd(sum, e);
      acc = vfma(e, load<T>(s[r].kv, ch, mask[h]), acc);
    }
    store_scratch(sum_row + ch, sum);
    store_scratch(acc_row + ch, acc);
  }
}

// Scratch: three rows of the width rounded up to a 32-channel group (the last
// group's vectors are loaded and stored whole).
template <DType T>
void rows_forward(const PoolArgs& a) {
  const std::int64_t padded = (a.width + 31) / 32 * 32;
  float* const max_row = a.scratch;  // then each channel's exp shift
  float* const sum_row = a.scratch + padded;
  float* const acc_row = a.scratch + 2 * padded;
  // Both passes step the next entry's prefetch once per group of each block of
  // rows: its lines are asked for evenly, not in bursts.
  BlockPrefetch prefetch(a, 2 * ((a.slot_count + kRowBlock - 1) / kRowBlock) * ((a.width + 31) / 32));
  for_row_blocks(a, prefetch, [&](auto rows, std::int64_t i, std::int64_t at, const auto& mask) {
    max_rows<T, decltype(rows)::value>(a.slots + i, at, mask, i == 0, max_row);
  });
  for_each_group(a.width, [&](std::int64_t at, const auto& mask) {
    Vec max[kGroup];
    for (int h = 0; h < kGroup; ++h) max[h] = safe_max(load_scratch(max_row + at + kLanes * h));
    if (a.stats) store_stats_row(a, 0, at, mask, max);
    for (int h = 0; h < kGroup; ++h) store_scratch(max_row + at + kLanes * h, exp_shift(max[h]));
  });
  for_row_blocks(a, prefetch, [&](auto rows, std::int64_t i, std::int64_t at, const auto& mask) {
    pool_rows<T, decltype(rows)::value>(a.slots + i, at, mask, i == 0, max_row, sum_row, acc_row);
  });
  for_each_group(a.width, [&](std::int64_t at, const auto& mask) {
    Vec out[kGroup], inv[kGroup];
    for (int h = 0; h < kGroup; ++h) {
      inv[h] = safe_reciprocal(load_scratch(sum_row + at + kLanes * h));
      out[h] = vmul(load_scratch(acc_row + at + kLanes * h), inv[h]);
    }
    store_group<T>(a.out, at, out, mask, false, has_nan<T>(out));
    if (a.stats) {
      store_stats_row(a, 1, at, mask, inv);
      store_stats_row(a, 2, at, mask, out);
    }
  });
}

// Backward from the forward's statistics: each slot's weight is
// exp(logit - max) / sum straight from its own logit, so the slots are
// independent and are walked row by row, each row front to back (the order
// the hardware prefetchers follow) in a single pass. g / sum and the exp
// shift (exp_shift of the saved max) per channel are formed once per entry,
// in two scratch rows of the width rounded up to a vector.
template <DType T>
void run_from_stats(const PoolArgs& a) {
  const float* out = a.stats + 2 * a.stats_stride;
  float* g_inv = a.scratch;
  float* shift = a.scratch + (a.width + kLanes - 1) / kLanes * kLanes;
  for (std::int64_t at = 0; at < a.width; at += kLanes) {
    const Lane mask = lane_mask(a.width - at);
    store_scratch(g_inv + at, vmul(load<T>(a.grad_out, at, mask), loadf(a.stats + a.stats_stride + at, mask)));
    store_scratch(shift + at, exp_shift(loadf(a.stats + at, mask)));
  }
  BlockPrefetch prefetch(a, a.slot_count * ((a.width + 31) / 32));
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const SlotRef& s = a.slots[i];
    for_each_group(a.width, [&](std::int64_t at, const auto& mask) DSA_POOL_GROUP_ATTRIBUTES {
      prefetch.step();
      Vec p[kGroup], kv[kGroup], run_out[kGroup], run_g_inv[kGroup];
      for (int h = 0; h < kGroup; ++h) {
        const std::int64_t ch = at + kLanes * h;
        p[h] = softmax_exp<T>(logit<T>(s, ch, mask[h]), loadf(shift + ch, mask[h]));
        kv[h] = load<T>(s.kv, ch, mask[h]);
        run_out[h] = loadf(out + ch, mask[h]);
        // Masked: the scratch rows end at the width rounded up to a vector,
        // not to a group.
        run_g_inv[h] = loadf(g_inv + ch, mask[h]);
      }
      slot_gradients<T>(s, at, mask, p, kv, run_out, run_g_inv, a.stream_gradients);
    });
  }
  _mm_sfence();  // streamed lines reach memory before the task ends
}

template <DType T, bool Backward>
void run(const PoolArgs& a) {
  switch (a.slot_count) {
    case 4: run_in_registers<T, 4, Backward>(a); break;
    case 8: run_in_registers<T, 8, Backward>(a); break;
    default:
      if constexpr (!Backward) {
        rows_forward<T>(a);
      } else {
        static_assert(kBackwardStrip == 32 || kBackwardStrip == 64,
                      "a strip is one or two groups (64 floats of scratch per slot)");
        BlockPrefetch prefetch(a, (a.width + kBackwardStrip - 1) / kBackwardStrip * a.slot_count);
        std::int64_t c0 = 0;
        for (; c0 + kBackwardStrip <= a.width; c0 += kBackwardStrip) {
          const Mask<WholeLane> mask[2] = {whole_mask(), whole_mask()};
          strip_backward<T, kBackwardStrip / 32>(a, c0, mask, prefetch);
        }
        if (const std::int64_t n = a.width - c0; n > 0) {
          const Mask<Lane> mask[2] = {tail_mask(n), tail_mask(n - 32)};
          if (kBackwardStrip == 64 && n > 32)
            strip_backward<T, 2>(a, c0, mask, prefetch);
          else
            strip_backward<T, 1>(a, c0, mask, prefetch);
        }
      }
  }
  if constexpr (Backward) _mm_sfence();  // streamed lines reach memory before the task ends
}

template <bool Backward>
void dispatch(const PoolArgs& a) {
  switch (a.dtype) {
    case DType::bf16: run<DType::bf16, Backward>(a); break;
    case DType::f16: run<DType::f16, Backward>(a); break;
    default: run<DType::f32, Backward>(a); break;
  }
}

void dispatch_from_stats(const PoolArgs& a) {
  switch (a.dtype) {
    case DType::bf16: run_from_stats<DType::bf16>(a); break;
    case DType::f16: run_from_stats<DType::f16>(a); break;
    default: run_from_stats<DType::f32>(a); break;
  }
}

}  // namespace

const PoolKernel& DSA_POOL_KERNEL_FUNCTION() {
  static const PoolKernel kernel{DSA_POOL_KERNEL_NAME, dispatch<false>, dispatch<true>, dispatch_from_stats};
  return kernel;
}

}  // namespace dsa::cpu::compressor_kernels
