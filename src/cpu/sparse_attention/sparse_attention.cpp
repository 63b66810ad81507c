// Fused CPU sparse attention: the driver. It resolves each query row's
// attended set into key-row pointers and hands blocks of them to the ISA's
// microkernels (attention_kernels.h). See docs/sparse_attention.md.
//
// Forward: tasks of a few query rows; each row streams its attended keys in
// blocks with an online softmax. Nothing of size [T, S] or [T, H, K] exists.
//
// Backward, deterministic for any thread count, in three phases:
//   1. per query row (parallel over rows): the softmax constants from the saved
//      statistics (coef, delta), the row's dsink terms, and dq/dq_rope;
//   2. per owned block of key rows (parallel over blocks; owner_rows_for): every
//      token that attends a key of the block, in ascending token order,
//      contributes to the block's fp32 accumulator, which is then written to
//      dkv / dkey_rope / dcmp_kv. Each key row has exactly one owner task and a
//      fixed summation order, so no result depends on scheduling;
//   3. dsinks: the per-row terms summed in row order.
// Phase 2 recomputes the logits and dP that phase 1 also computed: two extra
// GEMMs per attended pair buy determinism without atomics or O(T*K*D) buffers.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "core/memory.h"
#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/select.h"
#include "cpu/sparse_attention/attention_kernels.h"
#include "ops/sparse_attention.h"

namespace dsa::cpu {
namespace {

using namespace attention_kernels;

constexpr std::int64_t kRowsPerTask = 4;

enum class Pass { forward, backward, decode };

std::atomic<bool>& pair_forward_for_testing() {
  static std::atomic<bool> on{false};
  return on;
}

std::atomic<bool>& recompute_weights_for_testing() {
  static std::atomic<bool> on{false};
  return on;
}

// What a kernel is chosen by: the inputs' dtype and the pass.
struct KernelQuery {
  DType dtype;
  Pass pass;
};

bool bf16_inputs(const KernelQuery& q) { return q.dtype == DType::bf16; }

// The forward's P.V stays on fp32 FMAs (its logits run on bf16 dots): with P
// rounded to bf16 the output that feeds the next layer carried measurably
// more error into a bf16 model's gradients (docs/sparse_attention.md); the
// backward's bf16 products did not, and run at 1.3x the FMA backward. The
// decode op's forward feeds no backward: it runs the pair kernel with P
// rounded once (Shape::bf16_p).
bool bf16_pair_pass(const KernelQuery& q) {
  return q.dtype == DType::bf16 && (q.pass == Pass::backward || q.pass == Pass::decode ||
                                    pair_forward_for_testing().load(std::memory_order_relaxed));
}

// Candidates, best first (cpu/select.h).
constexpr Candidate<AttentionKernel, KernelQuery> kAttentionKernels[] = {
    {core::Isa::amx, amx_kernel, bf16_inputs},
    {core::Isa::avx512_bf16, avx512_bf16_kernel, bf16_pair_pass},
    {core::Isa::avx512_bf16, avx512_bf16_forward_kernel, bf16_inputs},
    {core::Isa::avx512, avx512_kernel},
    {core::Isa::avx2, avx2_kernel},
    {core::Isa::portable, portable_kernel},
};

const AttentionKernel& pick_kernel(DType dtype, Pass pass) { return select_kernel(kAttentionKernels, {dtype, pass}); }

Shape shape_of(const SparseAttentionProblem& p) {
  return Shape{p.dtype, p.heads, p.dim, p.rope_dim, p.d_v, p.scale};
}

using RowTask = core::QueryBlock;

// Row tasks of every sequence's rows in the global row range [lo, hi), longest
// first (balance; never changes results).
std::vector<RowTask> row_tasks(const SparseAttentionProblem& p, std::int64_t lo = 0,
                               std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
  return core::query_blocks(
      p.plan, kRowsPerTask,
      [&](const core::SequenceSlice& seq, std::int64_t first, std::int64_t rows) {
        const auto w = p.row_window(seq, first + rows - 1);
        const std::int64_t raw = p.indices ? p.topk : w.pos - w.raw_lo + 1;
        const std::int64_t cmp = p.cmp_kv ? (p.cmp_indices ? p.cmp_topk : w.cmp_visible) : 0;
        return rows * (raw + cmp + 1);
      },
      lo, hi);
}

// The most keys any query row can attend: the size of a row's pointer list.
std::int64_t max_attended(const SparseAttentionProblem& p) {
  std::int64_t max_k = 0, max_c = 0;
  for (const auto& s : p.plan.seqs) {
    max_k = std::max(max_k, s.k_len);
    max_c = std::max(max_c, s.c_len);
  }
  std::int64_t raw = p.indices ? p.topk : (p.window > 0 ? std::min(p.window, max_k) : max_k);
  std::int64_t cmp = p.cmp_kv ? (p.cmp_indices ? p.cmp_topk : max_c) : 0;  // duplicates count
  return raw + cmp;
}

using RowWindow = SparseAttentionProblem::RowWindow;

// Whether entry j of a row's explicit raw / compressed index list is attended:
// in the sequence and causal (the rule of gather_row, invert and raw_attended).
bool raw_index_valid(std::int64_t j, const core::SequenceSlice& seq, const RowWindow& w) {
  return j >= 0 && j < seq.k_len && j <= w.pos;
}
bool cmp_index_valid(std::int64_t j, const core::SequenceSlice& seq, const RowWindow& w) {
  return j >= 0 && j < seq.c_len && j < w.cmp_visible;
}

// Entries of query i's raw part, which leads its attended list (gather_row).
std::int64_t raw_attended(const SparseAttentionProblem& p, const core::SequenceSlice& seq, std::int64_t i) {
  const auto w = p.row_window(seq, i);
  if (!p.indices) return std::max<std::int64_t>(0, w.pos - w.raw_lo + 1);
  const std::int32_t* idx = p.indices + (seq.q_begin + i) * p.idx_row_stride;
  std::int64_t n = 0;
  for (std::int64_t k = 0; k < p.topk; ++k) n += raw_index_valid(idx[k], seq, w);
  return n;
}

struct RowPointers {
  std::vector<const char*> main, rope;
};

// Builds the attended key rows of query i of `seq`, in spec order: raw part
// (indices as given, or the band ascending), then the compressed part.
KeyRows gather_row(const SparseAttentionProblem& p, const core::SequenceSlice& seq, std::int64_t i,
                   RowPointers& ptrs) {
  const std::size_t es = dtype_size(p.dtype);
  const char* kv = static_cast<const char*>(p.kv);
  const char* kr = static_cast<const char*>(p.key_rope);
  const char* ckv = static_cast<const char*>(p.cmp_kv);
  const std::int64_t row = seq.q_begin + i;
  const auto w = p.row_window(seq, i);
  std::int64_t n = 0;
  auto add_raw = [&](std::int64_t j) {
    const std::int64_t r = seq.k_begin + j;
    ptrs.main[n] = kv + r * p.kv_row_stride * es;
    ptrs.rope[n++] = kr ? kr + r * p.kr_row_stride * es : nullptr;
  };
  if (p.indices) {
    const std::int32_t* idx = p.indices + row * p.idx_row_stride;
    for (std::int64_t k = 0; k < p.topk; ++k) {
      const std::int64_t j = idx[k];
      if (raw_index_valid(j, seq, w)) add_raw(j);
    }
  } else {
    for (std::int64_t j = w.raw_lo; j <= w.pos; ++j) add_raw(j);
  }
  if (ckv) {
    auto add_cmp = [&](std::int64_t c) {
      ptrs.main[n] = ckv + (seq.c_begin + c) * p.cmp_row_stride * es;
      ptrs.rope[n++] = nullptr;
    };
    if (p.cmp_indices) {
      const std::int32_t* idx = p.cmp_indices + row * p.cidx_row_stride;
      for (std::int64_t k = 0; k < p.cmp_topk; ++k) {
        const std::int64_t c = idx[k];
        if (cmp_index_valid(c, seq, w)) add_cmp(c);
      }
    } else {
      for (std::int64_t c = 0; c < w.cmp_visible; ++c) add_cmp(c);
    }
  }
  return KeyRows{ptrs.main.data(), ptrs.rope.data(), n};
}

QueryRow query_row(const SparseAttentionProblem& p, std::int64_t row) {
  const std::size_t es = dtype_size(p.dtype);
  QueryRow q;
  q.q = static_cast<const char*>(p.query) + row * p.q_row_stride * es;
  q.q_head_stride = p.q_head_stride;
  q.q_rope = p.query_rope ? static_cast<const char*>(p.query_rope) + row * p.qr_row_stride * es : nullptr;
  q.q_rope_head_stride = p.qr_head_stride;
  return q;
}

struct Scratch {
  core::ScratchVector<std::uint8_t> bytes;  // through dsa's allocator: a failure names its size
  RowPointers ptrs;
  void* aligned() {
    return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(bytes.data()) + 63) & ~std::uintptr_t(63));
  }
};

std::vector<Scratch> make_scratch(int threads, std::size_t bytes, std::int64_t pointers) {
  std::vector<Scratch> s(threads);
  for (auto& t : s) {
    t.bytes.resize(bytes + 64);
    t.ptrs.main.resize(std::max<std::int64_t>(pointers, 1));
    t.ptrs.rope.resize(std::max<std::int64_t>(pointers, 1));
  }
  return s;
}

// Rows of the owned dkv blocks of an index set of `topk` entries per query
// over sequences of up to `max_len` keys: about 32 of a token's entries per
// block when they are spread at random (a wider block would only grow the
// per-thread accumulator). Depends on shapes only, never on the thread count,
// so the summation order stays fixed.
std::int64_t owner_rows_for(std::int64_t topk, std::int64_t max_len) {
  std::int64_t rows = kMinOwnerBlock;
  // In 128 bits: topk and the lengths may be anything a view can claim.
  while (rows < kMaxOwnerBlock && static_cast<__int128>(rows) * topk < static_cast<__int128>(32) * max_len) rows *= 2;
  return rows;
}

// Key rows owned by one dkv task: rows [first, first + count) of sequence
// `seq`'s raw keys (compressed == false) or compressed entries.
struct OwnerBlock {
  bool compressed;
  std::int64_t seq, first, count;
};

// Explicit index lists inverted by owner block: bucket b holds (row, offset)
// pairs in ascending row order, then index slot order (a counting sort).
struct InvertedIndex {
  std::vector<std::int64_t> start;  // [blocks + 1]
  // Global query rows: 64-bit, as a packed batch may hold more than 2^31 rows
  // in all (int32 had been enough only for one sequence's local positions).
  std::vector<std::int64_t> rows;
  std::vector<std::uint16_t> offsets;
  // Each pair's place in its row's attended list (TokenEntries::slots); only
  // where the backward keeps weights.
  std::vector<std::int32_t> slots;
};

// raw_counts (with slots on compressed lists): each row's raw entries, where its
// compressed slots begin.
InvertedIndex invert(const SparseAttentionProblem& p, bool compressed, const std::vector<std::int64_t>& block_base,
                     std::int64_t owner_rows, bool with_slots, const std::int32_t* raw_counts) {
  InvertedIndex inv;
  const std::int64_t blocks = block_base.back();
  inv.start.assign(blocks + 1, 0);
  const std::int32_t* indices = compressed ? p.cmp_indices : p.indices;
  const std::int64_t stride = compressed ? p.cidx_row_stride : p.idx_row_stride;
  const std::int64_t k_count = compressed ? p.cmp_topk : p.topk;
  auto for_each_valid = [&](auto&& visit) {
    for (std::int64_t b = 0; b < static_cast<std::int64_t>(p.plan.seqs.size()); ++b) {
      const auto& seq = p.plan.seqs[b];
      for (std::int64_t i = 0; i < seq.q_len; ++i) {
        const std::int64_t row = seq.q_begin + i;
        const auto w = p.row_window(seq, i);
        const std::int32_t* idx = indices + row * stride;
        // The row's attended list holds its valid entries in slot order, the
        // compressed ones after the raw part.
        std::int64_t slot = compressed && with_slots ? raw_counts[row] : 0;
        for (std::int64_t k = 0; k < k_count; ++k) {
          const std::int64_t j = idx[k];
          const bool valid = compressed ? cmp_index_valid(j, seq, w) : raw_index_valid(j, seq, w);
          if (valid) visit(block_base[b] + j / owner_rows, row, j % owner_rows, slot++);
        }
      }
    }
  };
  for_each_valid([&](std::int64_t block, std::int64_t, std::int64_t, std::int64_t) { ++inv.start[block + 1]; });
  for (std::int64_t b = 0; b < blocks; ++b) inv.start[b + 1] += inv.start[b];
  inv.rows.resize(inv.start.back());
  inv.offsets.resize(inv.start.back());
  if (with_slots) inv.slots.resize(inv.start.back());
  std::vector<std::int64_t> fill(inv.start.begin(), inv.start.end() - 1);
  for_each_valid([&](std::int64_t block, std::int64_t row, std::int64_t offset, std::int64_t slot) {
    const std::int64_t at = fill[block]++;
    inv.rows[at] = row;
    inv.offsets[at] = static_cast<std::uint16_t>(offset);
    if (with_slots) inv.slots[at] = static_cast<std::int32_t>(slot);  // < max_attended, checked by the caller
  });
  return inv;
}

// dO . out of one head, in fp32 with 8 independent partial sums (vectorisable).
float row_dot(const char* a, const char* b, DType dtype, std::int64_t n) {
  float acc[8] = {};
  auto run = [&](auto load) {
    std::int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] += load(a, i + l) * load(b, i + l);
    for (; i < n; ++i) acc[0] += load(a, i) * load(b, i);
  };
  switch (dtype) {
    case DType::bf16:
      run([](const char* p, std::int64_t i) {
        std::uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        return core::bf16_to_float(v);
      });
      break;
    case DType::f16:
      run([](const char* p, std::int64_t i) {
        std::uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        return core::f16_to_float(v);
      });
      break;
    default:
      run([](const char* p, std::int64_t i) {
        float v;
        std::memcpy(&v, p + 4 * i, 4);
        return v;
      });
      break;
  }
  float sum = 0.0f;
  for (float v : acc) sum += v;
  return sum;
}

std::atomic<std::int64_t>& backward_chunk_limit_for_testing() {
  static std::atomic<std::int64_t> rows{0};
  return rows;
}

// Query rows per chunk of the backward's phases 1 and 2. The bf16 pair kernels
// keep ~110 KiB of packed query and grad_out per row between the phases (heads
// padded to 16 and 32), 6.8 GiB at 64 Ki rows with H = 8: a chunk keeps that
// to ~512 MiB. Each chunk reloads every owned block's keys and fp32 sums, so a
// chunk is never under 1024 rows, where that reload is small against the
// chunk's own work. Kernels with no packed state run in one chunk.
constexpr std::size_t kPackedBudget = std::size_t{512} << 20;
// Kept weights (Shape::kept_keys) are 1 MiB a row at H = 64 with 2048 keys in
// fp32: a chunk keeps 128 MiB of them. Their dkv pass reloads no keys, only
// the blocks' fp32 sums (9 MiB at 4096 keys of 576 dims), so a chunk may be
// as short as kMinKeptChunk rows. Rows longer than that allows (dense causal
// attention over 64 Ki keys at H = 64: 32 MiB a row) keep nothing: their dkv
// pass recomputes. 256 MiB chunks were 0-4 % faster (Zen 1 EPYC, V3.2 backward
// on 4096 and 131072 keys, builds alternated) for 128 MiB more memory.
constexpr std::size_t kKeptBudget = std::size_t{128} << 20;
constexpr std::int64_t kMinKeptChunk = 32;

std::int64_t backward_chunk_rows(std::size_t packed_row_bytes, bool kept_weights) {
  if (const std::int64_t limit = backward_chunk_limit_for_testing().load(std::memory_order_relaxed); limit > 0)
    return limit;
  if (packed_row_bytes == 0) return std::numeric_limits<std::int64_t>::max();
  if (kept_weights) return static_cast<std::int64_t>(kKeptBudget / packed_row_bytes);  // >= kMinKeptChunk
  return std::max<std::int64_t>(1024, static_cast<std::int64_t>(kPackedBudget / packed_row_bytes));
}

// Keys per row whose weights the backward keeps (Shape::kept_keys), or 0.
std::int64_t kept_keys_for(const AttentionKernel& kernel, const SparseAttentionProblem& p, Shape shape) {
  if (!kernel.keeps_weights || recompute_weights_for_testing().load(std::memory_order_relaxed)) return 0;
  const std::int64_t attended = max_attended(p);
  if (attended <= 0 || attended > std::numeric_limits<std::int32_t>::max()) return 0;  // slots are int32
  if (static_cast<__int128>(attended) * p.heads > static_cast<__int128>(kKeptBudget)) return 0;  // before any size_t product
  shape.kept_keys = attended;
  const std::size_t row_bytes = kernel.packed_row_bytes(shape);
  return row_bytes * kMinKeptChunk <= kKeptBudget ? attended : 0;
}

}  // namespace

namespace attention_kernels {
const AttentionKernel& pick_forward_kernel(DType dtype) { return pick_kernel(dtype, Pass::forward); }
const AttentionKernel& pick_decode_kernel(DType dtype) { return pick_kernel(dtype, Pass::decode); }
void use_pair_forward_for_testing(bool on) { pair_forward_for_testing().store(on); }
void limit_backward_chunk_rows_for_testing(std::int64_t rows) { backward_chunk_limit_for_testing().store(rows); }
void recompute_backward_weights_for_testing(bool on) { recompute_weights_for_testing().store(on); }
}  // namespace attention_kernels

void sparse_attention_fwd(const SparseAttentionProblem& p) {
  // No query rows: nothing to write, and the scratch must not be sized from H
  // and D, which no memory bounds then (fuzz_sparse_attention found a
  // [0, 2^40, 1] query asking for terabytes of scratch).
  if (p.plan.q_rows == 0) return;
  const AttentionKernel& kernel = pick_kernel(p.dtype, Pass::forward);
  const Shape shape = shape_of(p);
  const std::int64_t H = p.heads;
  const std::size_t out_row_bytes = static_cast<std::size_t>(H * p.d_v) * dtype_size(p.dtype);
  core::advise_huge_pages(p.out, out_row_bytes * static_cast<std::size_t>(p.plan.q_rows));  // written in full
  for (std::int64_t row : core::padding_rows(p.plan)) {
    std::memset(static_cast<char*>(p.out) + row * out_row_bytes, 0, out_row_bytes);
    std::fill(p.softmax_max + row * H, p.softmax_max + (row + 1) * H, core::kNegInf);
    std::fill(p.softmax_sum + row * H, p.softmax_sum + (row + 1) * H, 0.0f);
  }
  const std::vector<RowTask> tasks = row_tasks(p);
  const int threads = std::max(1, std::min<int>(p.num_threads, static_cast<int>(tasks.size())));
  std::vector<Scratch> scratch = make_scratch(threads, kernel.scratch_bytes(shape), max_attended(p));
  core::parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t t, int thread) {
    const RowTask& task = tasks[t];
    const auto& seq = p.plan.seqs[task.seq];
    Scratch& s = scratch[thread];
    for (std::int64_t i = task.first; i < task.first + task.tokens; ++i) {
      const std::int64_t row = seq.q_begin + i;
      const KeyRows keys = gather_row(p, seq, i, s.ptrs);
      kernel.forward_row(shape, p.sinks, query_row(p, row), keys, s.aligned(),
                         static_cast<char*>(p.out) + row * out_row_bytes, p.softmax_max + row * H,
                         p.softmax_sum + row * H);
    }
  });
}

void sparse_attention_bwd(const SparseAttentionProblem& p) {
  const AttentionKernel& kernel = pick_kernel(p.dtype, Pass::backward);
  const std::int64_t H = p.heads, dv = p.d_v;
  const std::size_t es = dtype_size(p.dtype);
  // Everything no task writes (padding rows, keys nobody attends) is zero.
  auto zero = [](void* data, std::int64_t bytes) {
    if (!data || bytes <= 0) return;
    core::advise_huge_pages(data, static_cast<std::size_t>(bytes));  // usually fresh gradient memory
    std::memset(data, 0, static_cast<std::size_t>(bytes));
  };
  zero(p.d_query, p.plan.q_rows * H * p.dim * es);
  zero(p.d_kv, p.kv_rows * p.dim * es);
  if (p.rope_dim) {
    zero(p.d_query_rope, p.plan.q_rows * H * p.rope_dim * es);
    zero(p.d_key_rope, p.kv_rows * p.rope_dim * es);
  }
  if (p.cmp_kv) zero(p.d_cmp_kv, p.cmp_rows * p.dim * es);
  if (p.d_sinks) std::fill(p.d_sinks, p.d_sinks + H, 0.0f);
  if (p.plan.q_rows == 0) return;  // the gradients are all zero; as in the forward, size nothing from H, D

  // The shapes only now: with no query rows the lengths may be anything a view can
  // claim, and max_attended would overflow (fuzz_sparse_attention, 2026-12-07; input
  // kept). Owned dkv blocks: widened for sparse explicit index sets
  // (owner_rows_for); implicit sets (band, every visible compressed entry) are dense
  // runs. kept_keys is set before the copies: one packed row layout for both kinds
  // of block.
  std::int64_t max_k_len = 0, max_c_len = 0;
  for (const auto& seq : p.plan.seqs) {
    max_k_len = std::max(max_k_len, seq.k_len);
    max_c_len = std::max(max_c_len, seq.c_len);
  }
  Shape shape = shape_of(p);
  if (p.indices) shape.owner_rows = owner_rows_for(p.topk, max_k_len);
  shape.kept_keys = kept_keys_for(kernel, p, shape);
  Shape cmp_shape = shape;
  cmp_shape.rope_dim = 0;
  cmp_shape.owner_rows = p.cmp_indices ? owner_rows_for(p.cmp_topk, max_c_len) : kMinOwnerBlock;
  Shape scratch_shape = shape;  // scratch for either kind of block
  scratch_shape.owner_rows = std::max(shape.owner_rows, cmp_shape.owner_rows);

  // Phases 1 and 2 run over chunks of query rows (backward_chunk_rows): the
  // kernel's per-row packed state lives for one chunk only, and each owned block
  // carries its fp32 sums from chunk to chunk. Chunks are taken in row order and
  // each block adds its tokens in row order within a chunk, so every key row sees
  // the same additions in the same order as in one pass: results do not depend
  // on the chunking either.
  const std::size_t packed_row = kernel.packed_row_bytes(shape);
  const std::int64_t chunk_rows = std::min(p.plan.q_rows, backward_chunk_rows(packed_row, shape.kept_keys > 0));
  const bool chunked = chunk_rows < p.plan.q_rows;
  core::ScratchVector<float> coef(p.plan.q_rows * H, 0.0f), delta(p.plan.q_rows * H, 0.0f);
  core::ScratchVector<float> sink_terms(p.sinks ? p.plan.q_rows * H : 0, 0.0f);
  const int threads = std::max(1, p.num_threads);
  const core::ScratchBuffer packed(packed_row * chunk_rows);  // not zeroed: every row that is read was written
  std::vector<Scratch> scratch = make_scratch(threads, kernel.scratch_bytes(scratch_shape), max_attended(p));

  // Owned key blocks of phase 2, and the explicit index sets inverted by block.
  std::vector<OwnerBlock> blocks;
  std::vector<std::int64_t> raw_base{0}, cmp_base{0};
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(p.plan.seqs.size()); ++b) {
    const auto& seq = p.plan.seqs[b];
    for (std::int64_t j = 0; j < seq.k_len; j += shape.owner_rows)
      blocks.push_back({false, b, j, std::min(shape.owner_rows, seq.k_len - j)});
    raw_base.push_back(static_cast<std::int64_t>(blocks.size()));
  }
  const std::int64_t n_raw_blocks = static_cast<std::int64_t>(blocks.size());
  if (p.cmp_kv)
    for (std::int64_t b = 0; b < static_cast<std::int64_t>(p.plan.seqs.size()); ++b) {
      const auto& seq = p.plan.seqs[b];
      for (std::int64_t j = 0; j < seq.c_len; j += cmp_shape.owner_rows)
        blocks.push_back({true, b, j, std::min(cmp_shape.owner_rows, seq.c_len - j)});
      cmp_base.push_back(static_cast<std::int64_t>(blocks.size()) - n_raw_blocks);
    }
  InvertedIndex raw_inv, cmp_inv;
  const bool slots = shape.kept_keys > 0;
  // Where weights are kept, each row's raw entry count: its compressed slots start
  // there. Counted once per row (an explicit list's count is a pass over it). An
  // explicit compressed list may come without compressed rows (every entry then
  // invalid): invert still reads the counts, so they follow cmp_indices too.
  std::vector<std::int32_t> raw_counts(slots && (p.cmp_kv || p.cmp_indices) ? p.plan.q_rows : 0);
  if (!raw_counts.empty())
    for (const auto& seq : p.plan.seqs)
      for (std::int64_t i = 0; i < seq.q_len; ++i)
        raw_counts[seq.q_begin + i] = static_cast<std::int32_t>(raw_attended(p, seq, i));  // <= kept_keys
  if (p.indices) raw_inv = invert(p, false, raw_base, shape.owner_rows, slots, nullptr);
  if (p.cmp_indices) cmp_inv = invert(p, true, cmp_base, cmp_shape.owner_rows, slots, raw_counts.data());
  // Per bucket, the first entry no chunk has taken yet (buckets are in row order).
  std::vector<std::int64_t> raw_next(raw_inv.start.begin(), raw_inv.start.end() - (p.indices ? 1 : 0));
  std::vector<std::int64_t> cmp_next(cmp_inv.start.begin(), cmp_inv.start.end() - (p.cmp_indices ? 1 : 0));
  // The blocks' running sums between chunks: [rows][qk dims] (a compressed entry has no rope part).
  const std::int64_t raw_width = shape.qk_dim(), cmp_width = cmp_shape.qk_dim();
  core::ScratchVector<float> raw_partial(chunked ? p.kv_rows * raw_width : 0, 0.0f);
  core::ScratchVector<float> cmp_partial(chunked && p.cmp_kv ? p.cmp_rows * cmp_width : 0, 0.0f);

  struct OwnerScratch {
    std::vector<TokenEntries> tokens;
    std::vector<std::uint16_t> offsets;
    std::vector<std::int32_t> slots;  // of implicit sets' entries, where weights are kept
    const char* main[kMaxOwnerBlock];
    const char* rope[kMaxOwnerBlock];
  };
  std::vector<OwnerScratch> owner(threads);

  for (std::int64_t lo = 0; lo < p.plan.q_rows; lo += chunk_rows) {
    const std::int64_t hi = std::min(p.plan.q_rows, lo + chunk_rows);
    auto packed_of = [&](std::int64_t row) { return packed_row ? packed.data() + (row - lo) * packed_row : nullptr; };
    auto row_backward = [&](std::int64_t row) {
      return RowBackward{static_cast<const char*>(p.grad_out) + row * p.go_row_stride * es, p.go_head_stride,
                         p.saved_max + row * H, coef.data() + row * H, delta.data() + row * H, packed_of(row)};
    };

    // Phase 1: per-row softmax constants, dsink terms and dq.
    const std::vector<RowTask> tasks = row_tasks(p, lo, hi);
    core::parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t t, int thread) {
      const RowTask& task = tasks[t];
      const auto& seq = p.plan.seqs[task.seq];
      Scratch& s = scratch[thread];
      for (std::int64_t i = task.first; i < task.first + task.tokens; ++i) {
        const std::int64_t row = seq.q_begin + i;
        for (std::int64_t h = 0; h < H; ++h) {
          const float m = p.saved_max[row * H + h], sum = p.saved_sum[row * H + h];
          if (m == core::kNegInf) continue;  // empty row: no gradient at all
          const SinkShare sink = sink_share(m, p.sinks, h);
          const float denom = sum * sink.scale_m + sink.sink_term;
          const float d = row_dot(static_cast<const char*>(p.grad_out) + (row * p.go_row_stride + h * p.go_head_stride) * es,
                                  static_cast<const char*>(p.fwd_out) + (row * p.o_row_stride + h * p.o_head_stride) * es,
                                  p.dtype, dv);
          coef[row * H + h] = sink.scale_m / denom;
          delta[row * H + h] = d;
          if (p.sinks) sink_terms[row * H + h] = -(sink.sink_term / denom) * d;
        }
        const KeyRows keys = gather_row(p, seq, i, s.ptrs);
        if (keys.count == 0) continue;
        kernel.backward_query_row(shape, query_row(p, row), row_backward(row), keys, s.aligned(),
                                  static_cast<char*>(p.d_query) + row * H * p.dim * es,
                                  p.rope_dim ? static_cast<char*>(p.d_query_rope) + row * H * p.rope_dim * es : nullptr);
      }
    });

    // Phase 2: the chunk's contributions to dkv / dkey_rope / dcmp_kv, by owned key blocks.
    core::parallel_for(static_cast<std::int64_t>(blocks.size()), threads, [&](std::int64_t t, int thread) {
      const OwnerBlock& blk = blocks[t];
      const auto& seq = p.plan.seqs[blk.seq];
      OwnerScratch& os = owner[thread];
      os.tokens.clear();
      auto make_token = [&](std::int64_t row, const std::uint16_t* offsets, std::int64_t count,
                            const std::int32_t* entry_slots) {
        os.tokens.push_back(TokenEntries{query_row(p, row), row_backward(row), offsets, count, entry_slots});
      };
      const std::int64_t key_row0 = (blk.compressed ? seq.c_begin : seq.k_begin) + blk.first;
      const InvertedIndex* inv = blk.compressed ? (p.cmp_indices ? &cmp_inv : nullptr) : (p.indices ? &raw_inv : nullptr);
      if (inv) {
        const std::int64_t bucket = blk.compressed ? t - n_raw_blocks : t;
        std::int64_t& next = blk.compressed ? cmp_next[bucket] : raw_next[bucket];  // this task's own
        while (next < inv->start[bucket + 1] && inv->rows[next] < hi) {
          std::int64_t end = next;
          while (end < inv->start[bucket + 1] && inv->rows[end] == inv->rows[next]) ++end;
          make_token(inv->rows[next], inv->offsets.data() + next, end - next, slots ? inv->slots.data() + next : nullptr);
          next = end;
        }
      } else {
        // Implicit sets (band, every visible compressed entry): the tokens that see
        // the block are a contiguous range; each sees a contiguous run of it.
        const std::int64_t shift = seq.k_len - seq.q_len;  // pos(i) = shift + i
        std::int64_t i_begin, i_end = std::min(seq.q_len, hi - seq.q_begin);
        if (blk.compressed) {
          i_begin = std::max<std::int64_t>(0, (blk.first + 1) * p.ratio - 1 - shift);
        } else {
          i_begin = std::max<std::int64_t>(0, blk.first - shift);
          if (p.window > 0) i_end = std::min(i_end, blk.first + blk.count - 1 + p.window - 1 - shift + 1);
        }
        i_begin = std::max(i_begin, lo - seq.q_begin);
        os.offsets.resize(std::max<std::int64_t>(0, i_end - i_begin) * blk.count);
        if (slots) os.slots.resize(os.offsets.size());
        std::int64_t used = 0;
        for (std::int64_t i = i_begin; i < i_end; ++i) {
          const auto w = p.row_window(seq, i);
          std::int64_t lo_key, hi_key;  // local entries [lo_key, hi_key) of the block
          if (blk.compressed) {
            lo_key = blk.first;
            hi_key = std::min(blk.first + blk.count, w.cmp_visible);
          } else {
            lo_key = std::max(blk.first, w.raw_lo);
            hi_key = std::min(blk.first + blk.count, w.pos + 1);
          }
          if (hi_key <= lo_key) continue;
          std::uint16_t* off = os.offsets.data() + used;
          for (std::int64_t j = lo_key; j < hi_key; ++j) off[j - lo_key] = static_cast<std::uint16_t>(j - blk.first);
          std::int32_t* slot = nullptr;
          if (slots) {  // the band ascending from raw_lo; compressed entries after the raw part
            slot = os.slots.data() + used;
            const std::int64_t first_slot = blk.compressed ? raw_counts[seq.q_begin + i] : -w.raw_lo;
            for (std::int64_t j = lo_key; j < hi_key; ++j) slot[j - lo_key] = static_cast<std::int32_t>(first_slot + j);
          }
          used += hi_key - lo_key;
          make_token(seq.q_begin + i, off, hi_key - lo_key, slot);
        }
      }
      if (os.tokens.empty()) return;  // nothing of this chunk: the block's sums stand
      for (std::int64_t k = 0; k < blk.count; ++k) {
        if (blk.compressed) {
          os.main[k] = static_cast<const char*>(p.cmp_kv) + (key_row0 + k) * p.cmp_row_stride * es;
          os.rope[k] = nullptr;
        } else {
          os.main[k] = static_cast<const char*>(p.kv) + (key_row0 + k) * p.kv_row_stride * es;
          os.rope[k] = p.key_rope ? static_cast<const char*>(p.key_rope) + (key_row0 + k) * p.kr_row_stride * es : nullptr;
        }
      }
      const KeyRows block_rows{os.main, os.rope, blk.count};
      if (blk.compressed) {
        kernel.backward_key_block(cmp_shape, block_rows, os.tokens.data(), static_cast<std::int64_t>(os.tokens.size()),
                                  scratch[thread].aligned(), chunked ? cmp_partial.data() + key_row0 * cmp_width : nullptr,
                                  static_cast<char*>(p.d_cmp_kv) + key_row0 * p.dim * es, nullptr);
      } else {
        kernel.backward_key_block(shape, block_rows, os.tokens.data(), static_cast<std::int64_t>(os.tokens.size()),
                                  scratch[thread].aligned(), chunked ? raw_partial.data() + key_row0 * raw_width : nullptr,
                                  static_cast<char*>(p.d_kv) + key_row0 * p.dim * es,
                                  p.rope_dim ? static_cast<char*>(p.d_key_rope) + key_row0 * p.rope_dim * es : nullptr);
      }
    });
  }

  // After the last chunk: the blocks' sums in the storage dtype (rows no token
  // attends summed nothing and stay zero, as in one pass).
  if (chunked) {
    auto store = [&](const float* sums, std::int64_t width, std::int64_t rows, void* d_main, void* d_rope) {
      core::parallel_for(rows, threads, [&](std::int64_t r, int) {
        const float* src = sums + r * width;
        for (std::int64_t j = 0; j < p.dim; ++j) core::store_float(d_main, p.dtype, r * p.dim + j, src[j]);
        for (std::int64_t j = p.dim; j < width; ++j)
          core::store_float(d_rope, p.dtype, r * (width - p.dim) + j - p.dim, src[j]);
      });
    };
    store(raw_partial.data(), raw_width, p.kv_rows, p.d_kv, p.d_key_rope);
    if (p.cmp_kv) store(cmp_partial.data(), cmp_width, p.cmp_rows, p.d_cmp_kv, nullptr);
  }

  // Phase 3: dsinks, summed in row order.
  if (p.d_sinks)
    for (std::int64_t r = 0; r < p.plan.q_rows; ++r)
      for (std::int64_t h = 0; h < H; ++h) p.d_sinks[h] += sink_terms[r * H + h];
}

}  // namespace dsa::cpu
