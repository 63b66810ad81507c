// Fused CPU sparse decode attention: the prefill forward's row kernels
// (attention_kernels.h) run on key records read in place from the paged
// caches. For bf16 the decode op takes the pair kernels (AMX tiles or
// vdpbf16ps) with P rounded to bf16 once, so P.V runs at the bf16 rate too:
// decode feeds no backward, the reason the prefill forward keeps P wider.
//
// Keys: a bf16 or fp32 record is the kernel's row as it is (a pointer into the
// cache, nothing copied); an FP8 record, or a storage dtype other than the
// kernel's, is dequantised once and serves every head: by the kernel's own
// gather where it takes a RowDecoder (the bf16 pair kernels: the next block's
// records are then fetched while the products run, as for bf16 records; the
// fp32 FMA kernels: one record at a time into an L1 row, then widened), else
// (portable) into a per-thread buffer a piece at a time.
// The kernel dtype is bf16 for bf16 queries over bf16 or FP8 caches (FP8
// codes times power-of-two scales are bf16 values exactly), fp32 otherwise.
//
// Splitting: a row's attended keys are cut into pieces (at most kMaxPiece, so
// the dequantised buffer is bounded) and the pieces into at most `groups`
// consecutive groups, one task each, so that a batch of one request keeps
// every core busy. Pieces and groups follow from the problem alone, and the
// partial softmaxes (fp32) merge in piece order: the bits never depend on the
// thread count. A row of one piece whose kernel dtype is the output's is the
// prefill forward's call exactly, written in place.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "core/memory.h"
#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/paged_cache/dequant.h"
#include "cpu/sparse_attention/attention_kernels.h"
#include "ops/sparse_attention_decode.h"

namespace dsa::cpu {
namespace {

using namespace attention_kernels;

// What a call's splits aim for: rows are split only while there are fewer than
// this many (a batch of 16 rows then runs each row whole, in place, with no
// partials to merge; a batch of one is cut into pieces for every core).
constexpr std::int64_t kTargetTasks = 16;
constexpr std::int64_t kMaxGroups = 16;
// A piece repacks the query (H x D) and merges an H x d_v partial: under ~512
// keys that overhead rivals the piece's own work at H = 128 (measured: 128-key
// pieces made a batch of one 2.7x slower than torch's gather + softmax, Zen 4).
constexpr std::int64_t kMinPiece = 512, kMaxPiece = 1024;
// Except that a row of fewer keys than 2 * kMinPiece (V4 HCA's 128 window keys
// and 256 entries at 32K) is still cut in two halves where the row may be split
// (a batch of one): half of the work per core costs more than one repack and
// merge from 128 keys a half on, the overhead being per head as the work is.
constexpr std::int64_t kMinHalf = 128;
// A dequantised piece is written to a buffer the kernel then reads back: at
// 1024 records of 1152 bytes that buffer filled a 1 MiB L2 (FP8 cache, batch
// 16: ~1.15x bf16's time, Zen 4, against ~1.05x at 448-record pieces; 224
// were slower again, merging more partials).
constexpr std::int64_t kDecodedPieceBytes = 512 << 10;  // 448 records of 1152 bytes

struct RowSplit {
  std::int64_t keys = 0, piece = 1, pieces = 1, groups = 1;
  // Pieces [first, end) of group g.
  std::int64_t first(std::int64_t g) const { return pieces > groups ? g * pieces / groups : g; }
  std::int64_t end(std::int64_t g) const { return pieces > groups ? (g + 1) * pieces / groups : g + 1; }
};

RowSplit split_row(std::int64_t keys, std::int64_t max_groups, std::int64_t max_piece) {
  RowSplit r;
  r.keys = keys;
  const std::int64_t even = (keys + max_groups - 1) / max_groups;
  r.piece = std::clamp<std::int64_t>((even + 31) / 32 * 32, std::min(kMinPiece, max_piece), max_piece);
  r.pieces = std::max<std::int64_t>(1, (keys + r.piece - 1) / r.piece);
  if (r.pieces > 1 && r.pieces % 2 == 1 && r.pieces < max_groups) {
    // An odd count of one-piece groups leaves a core idle for the last one: 2048 keys
    // in dequantised pieces of 448 keys made 5 tasks, 3 rounds on 2 cores (FP8 through
    // the buffer, batch 1, H = 128: 9 % slower than 6 pieces, Zen 1 class AVX2). One
    // more piece, all shorter (below), gives each of 2 cores the same share.
    ++r.pieces;
  }
  if (r.pieces == 1 && max_groups > 1 && keys >= 2 * kMinHalf) r.pieces = 2;  // a short row: one half per core
  // Pieces of equal length (to 32 keys): DeepSeek-V4's 640 keys a row (128 window +
  // 512 compressed) made pieces of 512 and 128, one core waiting on the other for
  // three quarters of the call.
  r.piece = std::max<std::int64_t>(32, ((keys + r.pieces - 1) / r.pieces + 31) / 32 * 32);
  r.pieces = std::max<std::int64_t>(1, (keys + r.piece - 1) / r.piece);
  r.groups = std::min(max_groups, r.pieces);
  return r;
}

// A softmax over some keys, per head: max logit m, sum of exp(l - m) s, and
// the output normalised by s. Empty: m = -inf, s = 0; keys without a number
// (NaN logits): s = NaN, which every merge keeps.
struct Partial {
  float* o;  // [heads][d_v]
  float* m;  // [heads]
  float* s;  // [heads]
};

void clear(const Partial& a, std::int64_t H, std::int64_t dv) {
  std::fill(a.o, a.o + H * dv, 0.0f);
  std::fill(a.m, a.m + H, core::kNegInf);
  std::fill(a.s, a.s + H, 0.0f);
}

// a <- a merged with b (b's keys after a's).
void merge(const Partial& a, const Partial& b, std::int64_t H, std::int64_t dv) {
  for (std::int64_t h = 0; h < H; ++h) {
    float* ao = a.o + h * dv;
    const float* bo = b.o + h * dv;
    if (std::isnan(a.s[h])) continue;
    if (std::isnan(b.s[h])) {
      a.s[h] = b.s[h];
      continue;
    }
    if (b.m[h] == core::kNegInf) continue;  // b empty
    if (a.m[h] == core::kNegInf) {          // a empty
      std::memcpy(ao, bo, dv * sizeof(float));
      a.m[h] = b.m[h], a.s[h] = b.s[h];
      continue;
    }
    const float m = std::max(a.m[h], b.m[h]);
    const float wa = a.s[h] * std::exp(a.m[h] - m), wb = b.s[h] * std::exp(b.m[h] - m);
    const float s = wa + wb, fa = wa / s, fb = wb / s;
    for (std::int64_t d = 0; d < dv; ++d) ao[d] = ao[d] * fa + bo[d] * fb;
    a.m[h] = m, a.s[h] = s;
  }
}

// The row's result from its merged partial: the sink joins the denominator.
void finish(const SparseAttentionDecodeProblem& p, const Partial& a, std::int64_t row) {
  const std::int64_t H = p.heads, dv = p.d_v;
  for (std::int64_t h = 0; h < H; ++h) {
    const float m = a.m[h], s = a.s[h];
    float f = 1.0f, lse = m + std::log(s);
    if (std::isnan(s)) {
      f = s;
    } else if (m == core::kNegInf) {
      f = 0.0f, lse = core::kNegInf;  // no keys: zeros
    } else if (p.sinks && p.sinks[h] != core::kNegInf) {
      const SinkShare sink = sink_share(m, p.sinks, h);  // the partial is already divided by s
      const float scaled = s * sink.scale_m;
      f = scaled / (scaled + sink.sink_term);
    }
    const std::int64_t o0 = (row * H + h) * dv;
    for (std::int64_t d = 0; d < dv; ++d) core::store_float(p.out, p.dtype, o0 + d, a.o[h * dv + d] * f);
    p.lse[row * H + h] = lse;
  }
}

struct Task {
  std::int64_t row, group;
};

// The RowDecoder of one piece: key k is records[k], from cmp where compressed[k].
struct PieceRecords {
  const SparseAttentionDecodeProblem* p;
  const std::uint8_t* const* records;
  const std::uint8_t* compressed;
  const dequant::Fp8Dequant* fp8;
};

void decode_record(const void* context, std::int64_t k, std::uint16_t* out) {
  const auto& piece = *static_cast<const PieceRecords*>(context);
  const core::PagedCache& cache = piece.compressed[k] ? piece.p->cmp : piece.p->kv;
  dequant::record_to_bf16(cache, piece.records[k], out, *piece.fp8);
}

void decode_record_f32(const void* context, std::int64_t k, float* out) {
  const auto& piece = *static_cast<const PieceRecords*>(context);
  const core::PagedCache& cache = piece.compressed[k] ? piece.p->cmp : piece.p->kv;
  dequant::record_to_f32(cache, piece.records[k], out, *piece.fp8);
}

struct ThreadScratch {
  // dsa's allocator (a failure names its size; cached between calls) and left
  // uninitialised: zeroing the kernel's ~0.4 MiB every call was ~4 % of a call at H = 16.
  std::unique_ptr<core::ScratchBuffer> kernel;
  std::vector<const std::uint8_t*> records;  // the task's attended records, in order
  std::vector<std::uint8_t> compressed;      // per record: from cmp (read only when a cache is decoded)
  std::vector<const char*> main;             // one piece's key rows as the kernel reads them
  std::unique_ptr<core::ScratchBuffer> decoded;  // [max_piece][dim] in the kernel dtype
  core::ScratchVector<float> query, piece_o, piece_m, piece_s;
  void* aligned() { return kernel->data(); }  // 64-byte aligned
};

}  // namespace

void sparse_attention_decode(const SparseAttentionDecodeProblem& p) {
  const std::int64_t H = p.heads, D = p.dim, dv = p.d_v, rows = p.rows();
  if (rows == 0) return;
  const DType kdt = dequant::kernel_dtype(p.dtype, {&p.kv, p.has_cmp ? &p.cmp : nullptr});
  const std::size_t kes = dtype_size(kdt);
  const bool kv_in_place = dequant::records_are_rows(p.kv, kdt),
             cmp_in_place = !p.has_cmp || dequant::records_are_rows(p.cmp, kdt);
  const AttentionKernel& kernel = pick_decode_kernel(kdt);
  const bool in_kernel = kdt == DType::bf16 && kernel.decodes_rows && (!kv_in_place || !cmp_in_place);
  const bool dequantising = !in_kernel && (!kv_in_place || !cmp_in_place);  // into a per-thread buffer
  const std::int64_t record_bytes =
      std::max(p.kv.token_bytes, p.has_cmp ? p.cmp.token_bytes : std::int64_t{0});
  const dequant::Fp8Dequant& fp8 = dequant::pick_fp8_dequant();
  Shape shape{kdt, H, D, 0, dv, p.scale};
  shape.bf16_p = true;
  shape.cache_keys = true;
  Shape partial_shape = shape;
  partial_shape.out_fp32 = true;

  // The split of every row, and its tasks.
  const std::int64_t max_piece =
      dequantising ? std::clamp<std::int64_t>(kDecodedPieceBytes / (D * static_cast<std::int64_t>(kes)) / 32 * 32,
                                              32, kMaxPiece)
                   : kMaxPiece;
  const std::int64_t max_groups = std::clamp<std::int64_t>((kTargetTasks + rows - 1) / rows, 1, kMaxGroups);
  std::vector<RowSplit> splits(rows);
  std::vector<std::int64_t> first_task(rows + 1, 0);
  std::vector<Task> tasks;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t n = 0;
    p.for_each_attended(r / p.next_n, r % p.next_n, [&](bool, std::int64_t) { ++n; });
    splits[r] = split_row(n, max_groups, max_piece);
    first_task[r] = static_cast<std::int64_t>(tasks.size());
    for (std::int64_t g = 0; g < splits[r].groups; ++g) tasks.push_back({r, g});
  }
  first_task[rows] = static_cast<std::int64_t>(tasks.size());
  // A row is written in place by its one task when it is one piece in the output dtype.
  auto direct = [&](std::int64_t r) { return splits[r].pieces == 1 && kdt == p.dtype; };

  // Merged partial of every task that is not direct: [tasks][H * dv + 2 H].
  const std::int64_t partial_floats = H * dv + 2 * H;
  core::ScratchVector<float> partials(static_cast<std::size_t>(tasks.size()) * partial_floats);
  auto partial_of = [&](std::int64_t t) {
    float* base = partials.data() + t * partial_floats;
    return Partial{base, base + H * dv, base + H * dv + H};
  };

  const int threads = std::max(1, std::min<int>(p.num_threads, static_cast<int>(tasks.size())));
  std::vector<ThreadScratch> scratch(threads);
  const std::int64_t max_keys = std::max<std::int64_t>(1, p.max_attended());
  for (auto& s : scratch) {
    s.kernel = std::make_unique<core::ScratchBuffer>(kernel.scratch_bytes(shape));
    s.main.resize(std::min(max_keys, max_piece));
    if (dequantising) s.decoded = std::make_unique<core::ScratchBuffer>(static_cast<std::size_t>(max_piece * D) * kes);
    s.query.resize(p.dtype == kdt ? 0 : H * D);
    s.piece_o.resize(H * dv);
    s.piece_m.resize(H);
    s.piece_s.resize(H);
  }

  core::parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t t, int thread) {
    const Task task = tasks[t];
    const std::int64_t b = task.row / p.next_n, j = task.row % p.next_n;
    const RowSplit& split = splits[task.row];
    ThreadScratch& s = scratch[thread];

    // The records of this task's keys [lo, hi) of the row (and which cache each
    // is from), then its query.
    const std::int64_t lo = split.first(task.group) * split.piece;
    const std::int64_t hi = std::min(split.keys, split.end(task.group) * split.piece);
    s.records.clear();
    s.compressed.clear();
    std::int64_t at = 0;
    p.for_each_attended(b, j, [&](bool compressed, std::int64_t pos) {
      if (at >= lo && at < hi) {
        s.records.push_back(p.record(b, compressed, pos));
        if (dequantising || in_kernel) s.compressed.push_back(compressed);
      }
      ++at;
    });
    const char* q = static_cast<const char*>(p.query) +
                    (b * p.q_batch_stride + j * p.q_row_stride) * static_cast<std::int64_t>(dtype_size(p.dtype));
    QueryRow query{q, p.q_head_stride, nullptr, 0};
    if (p.dtype != kdt) {  // fp32 kernel for an fp16 or bf16 query
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d)
          s.query[h * D + d] = core::load_float(q, p.dtype, h * p.q_head_stride + d);
      query = QueryRow{reinterpret_cast<const char*>(s.query.data()), D, nullptr, 0};
    }

    const Partial acc = partial_of(t);
    if (!direct(task.row)) clear(acc, H, dv);
    const Partial piece{s.piece_o.data(), s.piece_m.data(), s.piece_s.data()};
    for (std::int64_t pc = split.first(task.group); pc < split.end(task.group); ++pc) {
      const std::int64_t k0 = pc * split.piece - lo;  // in this task's records
      const std::int64_t n = std::max<std::int64_t>(0, std::min(split.piece, hi - lo - k0));
      for (std::int64_t k = 0; k < n; ++k) {
        const std::uint8_t* rec = s.records[k0 + k];
        if (in_kernel) {  // the kernel decodes it
          s.main[k] = reinterpret_cast<const char*>(rec);
          continue;
        }
        const bool compressed = dequantising && s.compressed[k0 + k];
        if (dequantising && k + kPrefetchRows < n) {
          // The records are a random walk over the cache: ask ahead, as the
          // kernels' own gathers do (FP8, batch 16: ~3 % faster, Zen 4).
          const std::int64_t ahead = k0 + k + kPrefetchRows;
          const char* next = reinterpret_cast<const char*>(s.records[ahead]);
          const std::int64_t bytes = (s.compressed[ahead] ? p.cmp : p.kv).token_bytes;
          for (std::int64_t byte = 0; byte < bytes; byte += 64) _mm_prefetch(next + byte, _MM_HINT_T0);
        }
        if (compressed ? cmp_in_place : kv_in_place) {
          s.main[k] = reinterpret_cast<const char*>(rec);
          continue;
        }
        // Dequantised once for every head.
        char* dst = reinterpret_cast<char*>(s.decoded->data()) + k * D * kes;
        const core::PagedCache& cache = compressed ? p.cmp : p.kv;
        if (kdt == DType::f32) core::decode_token(cache, rec, reinterpret_cast<float*>(dst));
        else dequant::record_to_bf16(cache, rec, reinterpret_cast<std::uint16_t*>(dst), fp8);
        s.main[k] = dst;
      }
      const PieceRecords piece_records{&p, s.records.data() + k0, in_kernel ? s.compressed.data() + k0 : nullptr,
                                       &fp8};
      // Straight to fp32 only where the FP8 kernel has that route (Fp8Dequant::has_f32_route).
      const RowDecoder decoder{decode_record, &piece_records, record_bytes,
                               fp8.has_f32_route() ? decode_record_f32 : nullptr};
      const KeyRows keys{s.main.data(), nullptr, n, in_kernel ? &decoder : nullptr};
      if (direct(task.row)) {
        const std::int64_t row = task.row;
        kernel.forward_row(shape, p.sinks, query, keys, s.aligned(),
                           static_cast<char*>(p.out) + row * H * dv * static_cast<std::int64_t>(dtype_size(p.dtype)),
                           piece.m, piece.s);
        for (std::int64_t h = 0; h < H; ++h)
          p.lse[row * H + h] = piece.m[h] + std::log(piece.s[h]);  // -inf + log 0: -inf for an empty row
        return;
      }
      kernel.forward_row(partial_shape, nullptr, query, keys, s.aligned(), piece.o, piece.m, piece.s);
      merge(acc, piece, H, dv);
    }
  });

  // Rows split over tasks: their groups merge in order, then the sink and one rounding.
  core::parallel_for(rows, std::max(1, std::min<int>(p.num_threads, static_cast<int>(rows))),
                     [&](std::int64_t r, int) {
                       if (direct(r)) return;
                       const Partial acc = partial_of(first_task[r]);
                       for (std::int64_t t = first_task[r] + 1; t < first_task[r + 1]; ++t)
                         merge(acc, partial_of(t), H, dv);
                       finish(p, acc, r);
                     });
}

}  // namespace dsa::cpu
