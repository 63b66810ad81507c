// Microkernels of the fused CPU sparse attention, one set per ISA.
//
// The driver (sparse_attention.cpp) decides *what* each query row attends and
// hands the kernels lists of key-row pointers; the kernels do the math on
// blocks of up to kKeyBlock gathered keys, sharing each gathered block across
// all query heads (one KV head). Nothing here allocates: scratch comes from
// the driver, sized by scratch_bytes().
//
// Conventions: a key is `dim` dims from its main row (kv or cmp_kv) followed
// by `rope_dim` dims from its rope row (key_rope; absent for compressed keys,
// which never carry a rope part); its value is the first d_v dims of the main
// row. Logits are scale * q . k, softmax and accumulation in fp32.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/numeric.h"
#include "dsa/tensor.h"

namespace dsa::cpu::attention_kernels {

inline constexpr std::int64_t kKeyBlock = 32;  // keys gathered per block (forward, dq pass)
// Key rows owned by one dkv task (Shape::owner_rows). The driver widens the
// block for explicit index sets that are sparse in a long sequence: a token's
// packed operands are read once per (token, owned block), so with top-2048 of
// 128 Ki keys a 256-row block would hold ~4 of a token's entries and phase 2
// would stream the token's query and grad_out once per 4 pairs.
inline constexpr std::int64_t kMinOwnerBlock = 256;
inline constexpr std::int64_t kMaxOwnerBlock = 2048;  // offsets are uint16; scratch grows with it

struct Shape {
  DType dtype;
  std::int64_t heads, dim, rope_dim, d_v;
  float scale;
  std::int64_t owner_rows = kMinOwnerBlock;  // rows of an owned dkv block: a multiple of 64, <= kMaxOwnerBlock
  // forward_row writes its output in fp32 whatever `dtype` (the decode op's
  // partial outputs over pieces of a row's keys, merged before one rounding).
  bool out_fp32 = false;
  // forward_row rounds P to bf16 once for P.V (one bf16 product) instead of
  // keeping it fp32 or split in two bf16 parts. Only the bf16 pair kernels
  // read it; the others keep P in fp32. The decode op sets it: its output
  // feeds no backward, and rounding P once is what the model's own bf16
  // attention does (docs/serving.md).
  bool bf16_p = false;
  // The keys are scattered records of a paged cache far larger than the caches
  // (the decode op): the pair kernels ask for the next block's records over the
  // products (cpu/isa/line_drip.h) rather than during the block's copy. Off for
  // prefill, whose keys mostly come from L2/L3 and gain nothing from it.
  bool cache_keys = false;
  // Backward: attended keys per query row (the most any row has) whose softmax
  // weights P and dS the dq pass keeps in the row's packed state for the dkv
  // pass, which then multiplies instead of recomputing the logits and dP (two
  // of the backward's seven GEMM-sized products per pair). 0: the dkv pass
  // recomputes them. The driver sets it only for kernels that keep weights
  // (AttentionKernel::keeps_weights) and only where a chunk of rows holds them
  // in its memory budget (long dense rows do not).
  std::int64_t kept_keys = 0;
  std::int64_t qk_dim() const { return dim + rope_dim; }
};

// Key rows that are not rows of the kernel's dtype in memory (an FP8 record of a
// paged cache): the kernel's gather has decode() write key k's `dim` bf16 values
// (rope_dim is 0) where it would copy the row, so the record is decoded once for
// every head and the fetch of the next block's records overlaps the products, as
// for rows read in place. main[k] is then the record, record_bytes long (what
// the kernel asks ahead for). Only kernels with AttentionKernel::decodes_rows
// accept a decoder.
struct RowDecoder {
  void (*decode)(const void* context, std::int64_t k, std::uint16_t* out);
  const void* context;
  std::int64_t record_bytes;
  // The same `dim` values in fp32, for the kernels that widen every key to
  // fp32 (the fp32 FMA kernels): a code goes to fp32 in fewer operations than
  // to bf16 and back.
  void (*decode_f32)(const void* context, std::int64_t k, float* out) = nullptr;
};

// Row pointers of gathered keys (storage dtype); rope[i] is null when rope_dim == 0.
struct KeyRows {
  const char* const* main;
  const char* const* rope;
  std::int64_t count;
  const RowDecoder* decoder = nullptr;
};

// Softmax sum, and output scale, of a head that has keys but no logit above
// -inf: all of them NaN (a NaN in the query, say) or -inf. The reference's
// sum of exp(l - max) is NaN there and so is its output; the kernels, whose
// max leaves NaN out, report the same instead of an empty row's zeros.
inline constexpr float kNoNumberSum = std::numeric_limits<float>::quiet_NaN();

// The gather of a block of attended keys asks for the row kPrefetchRows ahead
// of the one it copies: the rows are a random walk over kv that the hardware
// prefetcher cannot follow, and a row (1 KiB and more) is too long for the
// core to run ahead into the next one by itself. Measured on the fp32 FMA
// forward (Zen 5, one thread, V3.2): 7-9% faster at 4-16 rows ahead.
inline constexpr std::int64_t kPrefetchRows = 16;
// Bytes of a key's main row as stored: the row, or the record a decoder reads.
inline std::int64_t main_row_bytes(const Shape& s, const KeyRows& keys) {
  return keys.decoder ? keys.decoder->record_bytes : s.dim * static_cast<std::int64_t>(dtype_size(s.dtype));
}

// Hint: _MM_HINT_T0 for a row about to be copied, _MM_HINT_T1 for one a block ahead.
template <decltype(_MM_HINT_T0) Hint = _MM_HINT_T0>  // GCC: enum _mm_hint; clang: int
inline void prefetch_key_row(const Shape& s, const KeyRows& keys, std::int64_t k) {
  if (k >= keys.count) return;
  const std::int64_t main_bytes = main_row_bytes(s, keys);
  for (std::int64_t byte = 0; byte < main_bytes; byte += 64)
    _mm_prefetch(keys.main[k] + byte, Hint);
  if (s.rope_dim) _mm_prefetch(keys.rope[k], Hint);
}

// Key k of `keys` as one contiguous row of `padded` storage elements: the main
// dims, the rope dims, zeros.
inline void copy_key_row(const Shape& s, const KeyRows& keys, std::int64_t k, std::int64_t padded, char* row) {
  const std::size_t es = dtype_size(s.dtype);
  if (keys.decoder) keys.decoder->decode(keys.decoder->context, k, reinterpret_cast<std::uint16_t*>(row));
  else std::memcpy(row, keys.main[k], s.dim * es);
  if (s.rope_dim) std::memcpy(row + s.dim * es, keys.rope[k], s.rope_dim * es);
  std::memset(row + s.qk_dim() * es, 0, (padded - s.qk_dim()) * es);
}

// One query row: all heads of one token.
struct QueryRow {
  const char* q;  // head h at q + h * q_head_stride elements
  std::int64_t q_head_stride;
  const char* q_rope;  // null when rope_dim == 0
  std::int64_t q_rope_head_stride;
};

// Per-head softmax constants of a row for the backward, from the forward's
// statistics: P_h(j) = exp(l_j - max_h) * coef_h, and delta_h = dO_h . out_h.
struct RowBackward {
  const char* grad_out;  // head h at grad_out + h * go_head_stride elements
  std::int64_t go_head_stride;
  const float* max;    // [heads]
  const float* coef;   // [heads]
  const float* delta;  // [heads]
  // Kernel-private per-row state that the dq pass writes and the dkv pass reads
  // (packed_row_bytes() per row; null when the kernel needs none).
  void* packed;
};

// One token's entries inside an owned key block (offsets into the block,
// duplicates repeated), for the dkv pass. slots[e] is entry e's place in the
// token's attended list (gather order: the raw part, then the compressed part),
// where the dq pass kept its weights (Shape::kept_keys; null when none are kept).
struct TokenEntries {
  QueryRow query;
  RowBackward row;
  const std::uint16_t* offsets;
  std::int64_t count;
  const std::int32_t* slots = nullptr;
};

struct AttentionKernel {
  const char* name;
  std::size_t (*scratch_bytes)(const Shape& shape);
  // Bytes of per-row state the backward keeps between its two passes (0: none).
  std::size_t (*packed_row_bytes)(const Shape& shape);
  // Forward of one query row over `keys` (all of its attended set, in order).
  // Writes out [heads][d_v] (storage dtype), max/sum [heads] (without sinks).
  void (*forward_row)(const Shape& shape, const float* sinks, const QueryRow& query,
                      const KeyRows& keys, void* scratch, void* out, float* max, float* sum);
  // dq of one query row: writes d_query [heads][dim] and d_query_rope
  // [heads][rope_dim] (storage dtype, contiguous).
  void (*backward_query_row)(const Shape& shape, const QueryRow& query, const RowBackward& row,
                             const KeyRows& keys, void* scratch, void* d_query, void* d_query_rope);
  // dkv of one owned block of `block.count` (<= shape.owner_rows) key rows:
  // accumulates every token's contribution in the given order and writes the
  // block's rows of d_main [count][dim] and d_rope [count][rope_dim]. With
  // `partial` (the driver runs the backward in chunks of query rows) the sums
  // start from, and go back to, the block's fp32 sums so far [count][qk_dim]
  // instead, and d_main / d_rope are not touched (start_block_sums, keep_block_sums).
  void (*backward_key_block)(const Shape& shape, const KeyRows& block, const TokenEntries* tokens,
                             std::int64_t n_tokens, void* scratch, float* partial, void* d_main, void* d_rope);
  // Whether forward_row reads keys with a RowDecoder (the bf16 pair kernels,
  // which gather every key through copy_key_row, and the fp32 FMA kernels'
  // load_keys).
  bool decodes_rows = false;
  // Whether the backward can keep P and dS between its passes (Shape::kept_keys:
  // packed_row_bytes then grows with it, and the dkv pass reads TokenEntries::slots).
  bool keeps_weights = false;
};

// backward_key_block's fp32 sums `acc` [rows][stride] (stride >= qk_dim, rows
// >= count): the block's sums so far from `partial` where there is one, zero
// everywhere else (padding dims and rows past the block included).
inline void start_block_sums(const Shape& s, const float* partial, std::int64_t count, std::int64_t rows,
                             std::int64_t stride, float* acc) {
  std::memset(acc, 0, static_cast<std::size_t>(rows * stride) * sizeof(float));
  if (!partial) return;
  for (std::int64_t k = 0; k < count; ++k)
    std::memcpy(acc + k * stride, partial + k * s.qk_dim(), static_cast<std::size_t>(s.qk_dim()) * sizeof(float));
}

// Writes the block's sums back to `partial` and says so; false (nothing
// written) when there is none and the kernel stores the gradient itself.
inline bool keep_block_sums(const Shape& s, const float* acc, std::int64_t count, std::int64_t stride,
                            float* partial) {
  if (!partial) return false;
  for (std::int64_t k = 0; k < count; ++k)
    std::memcpy(partial + k * s.qk_dim(), acc + k * stride, static_cast<std::size_t>(s.qk_dim()) * sizeof(float));
  return true;
}

namespace {  // internal linkage: compiled into files built for different ISAs

// A head's softmax with a sink (DeepSeek-V4's per-head logit that takes
// probability mass and gives no value): with the row's max m and sum of
// exp(logit - m), the denominator is sum * scale_m + sink_term. Both terms are
// relative to max(m, sink), so a large sink cannot overflow; without a sink
// (null or -inf) they are 1 and 0; a +inf sink takes all the mass (0 and 1, the
// limit, where exp(sink - top) would be NaN), unless a logit is +inf too. Every
// attention kernel and the backward's coefficients finish through this one form.
struct SinkShare {
  float scale_m = 1.0f, sink_term = 0.0f;
};

inline SinkShare sink_share(float m, const float* sinks, std::int64_t h) {
  SinkShare out;
  if (sinks && sinks[h] == core::kPosInf && m != core::kPosInf) {
    out.scale_m = 0.0f;
    out.sink_term = 1.0f;
  } else if (sinks && sinks[h] != core::kNegInf) {
    const float top = std::max(m, sinks[h]);
    out.scale_m = std::exp(m - top);
    out.sink_term = std::exp(sinks[h] - top);
  }
  return out;
}

// A head's finished row from the lazy online softmax: its running sum is relative
// to `ref_max` (rescaled only when the max grew by more than a margin), its
// statistics to the true max `m`. Writes the statistics and returns the factor of
// the accumulated output: 0 for a row with no keys; NaN (sum too) for a row whose
// keys' logits are all NaN or -inf, as the reference gives.
inline float finish_head(float m, float ref_max, float sum, const float* sinks, std::int64_t h,
                         std::int64_t key_count, float* max_out, float* sum_out) {
  if (m == core::kNegInf) {
    max_out[h] = core::kNegInf;
    sum_out[h] = 0.0f;
    return key_count > 0 ? (sum_out[h] = kNoNumberSum) : 0.0f;
  }
  const float to_true = std::exp(ref_max - m);
  const float total = sum * to_true;
  const SinkShare sink = sink_share(m, sinks, h);
  max_out[h] = m;
  sum_out[h] = total;
  return to_true * sink.scale_m / (total * sink.scale_m + sink.sink_term);
}

}  // namespace

const AttentionKernel& portable_kernel();
const AttentionKernel& avx2_kernel();
const AttentionKernel& avx512_kernel();
// AMX-BF16 for bf16 inputs: the forward and dq pass use tiles; returns the
// avx512 entries where it has none of its own.
const AttentionKernel& amx_kernel();
// The same algorithm on AVX-512-BF16 dot products (bf16 inputs, no AMX).
const AttentionKernel& avx512_bf16_kernel();
// The fp32 FMA kernels with the forward's logits on AVX-512-BF16 dot products
// (bf16 inputs): the bf16 forward of avx512_bf16_kernel().
const AttentionKernel& avx512_bf16_forward_kernel();

// The forward kernel the fused backend picks for inputs of this dtype (the
// prefill forward's choice, cpu/select.h).
const AttentionKernel& pick_forward_kernel(DType dtype);
// The decode op's choice: for bf16, the pair kernels (every product on bf16
// dots, P rounded once when the shape says bf16_p).
const AttentionKernel& pick_decode_kernel(DType dtype);

// Tests only: at the avx512_bf16 level the bf16 forward runs avx512_bf16_kernel()'s
// own, the AMX forward's algorithm, which otherwise only AMX CPUs run.
void use_pair_forward_for_testing(bool on);
// Tests only: the backward's chunks of query rows hold at most `rows` rows
// (0: the memory budget decides, as in use); the results must not change.
void limit_backward_chunk_rows_for_testing(std::int64_t rows);
// Tests only: the backward keeps no weights between its passes (Shape::kept_keys
// stays 0) and its dkv pass recomputes them, as for rows too long to keep.
void recompute_backward_weights_for_testing(bool on);

}  // namespace dsa::cpu::attention_kernels
