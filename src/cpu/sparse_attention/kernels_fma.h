// fp32 FMA attention kernels, register-blocked, for every input dtype on AVX2
// and AVX-512 CPUs (and for fp16 / fp32 inputs on AVX-512-BF16 and AMX CPUs).
// Included by kernels_avx2.cpp (8-lane ymm) and kernels_avx512.cpp (16-lane
// zmm), which name the kernel through DSA_FMA_KERNEL_NAME / _LABEL.
//
// The structure is the pair kernels' (kernels_pairs.h) with fp32 operands:
// every gathered key block is converted to fp32 once and shared by all heads,
// the query row is packed once per row, and each product is one call of a
// register-blocked GEMM, C (+)= A . B, whose A elements are broadcast (any row
// pointers, any column step) and whose B rows are contiguous vectors:
//   forward   S^T [keys][heads] = Kb . Q^T      (A = key rows, B = Q^T)
//             O [heads][d_v]   += P . V         (A = P read down S^T's columns, B = key rows)
//   dq pass   S^T, dP^T = Kb . dO^T, dS^T, then dQ [heads][dims] += dS . Kb
//   dkv pass  per token: S^T, dP^T for its entries of the owned block, then
//             dK rows += dS^T . Q and dV rows += P^T . dO straight into the
//             block's fp32 accumulator rows. Where the driver lets the dq pass
//             keep P and dS (Shape::kept_keys), the dkv pass reads them instead
//             of recomputing S^T and dP^T: 5 GEMM-sized products a pair, not 7.
// The softmax is vectorised over heads (S^T rows), with the pair kernels'
// lazily updated reference max. Accumulation orders are fixed: results do not
// depend on the thread count.
//
// kernels_fma_avx512bf16.cpp compiles the forward alone with DSA_FMA_BF16_SCORES
// (bf16 inputs on AVX-512-BF16 CPUs): S^T on the vdpbf16ps engine straight from
// the bf16 key rows, P.V as here.
#include <immintrin.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "cpu/isa/fma.h"
#include "cpu/sparse_attention/attention_kernels.h"
#if defined(DSA_FMA_BF16_SCORES)
#if !defined(__AVX512BF16__)
#error "DSA_FMA_BF16_SCORES needs a *_avx512bf16.cpp file"
#endif
#include "cpu/isa/avx512bf16_gemm.h"
#endif

namespace dsa::cpu::attention_kernels {
namespace {

using namespace fma;

constexpr std::int64_t kBlock = 96;   // keys per forward / dq block, and entries per dkv chunk
constexpr float kLazy = 8.0f;         // exp(8) ~ 3e3: far from fp32 limits
constexpr std::int64_t kPointers = kBlock;  // row pointers, at least (a dkv chunk holds at most kBlock entries)

std::int64_t pad(std::int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Conversions: cpu/isa/rows.h (to_float through fma.h).
using rows::from_float;

struct Dims {
  std::int64_t hp, dp, dvp;  // heads, qk dims and value dims padded to whole vectors
  explicit Dims(const Shape& s) : hp(pad(s.heads)), dp(pad(s.qk_dim())), dvp(pad(s.d_v)) {}
};

// A GEMM's rows are keys (at most kPointers) or heads.
std::int64_t pointer_count(const Dims& d) { return std::max(kPointers, d.hp); }

#if defined(DSA_FMA_BF16_SCORES)
// The logits S^T = Kb . Q^T on vdpbf16ps: bf16 products are exact in fp32 and
// the engine sums them in fp32, as the FMA product would (in another order).
// Only P.V needs fp32 operands: P rounded to bf16 carried measurably more
// error into a bf16 model's gradients (docs/sparse_attention.md).
struct ScoreDims {
  std::int64_t dp32, chunks, groups;  // qk dims padded to 32; heads in groups of 16
  explicit ScoreDims(const Shape& s)
      : dp32((s.qk_dim() + 31) / 32 * 32), chunks(dp32 / 32), groups((s.heads + 15) / 16) {}
};

// Query row -> Q^T in pairs of dims: [chunks][groups][16 pairs][16 heads][2].
void pack_query_pairs(const Shape& s, const ScoreDims& sd, const QueryRow& q, std::uint32_t* qb) {
  const auto* base = reinterpret_cast<const std::uint16_t*>(q.q);
  const auto* rope = reinterpret_cast<const std::uint16_t*>(q.q_rope);
  const std::int64_t pairs = sd.dp32 / 2;
  std::fill(qb, qb + pairs * sd.groups * 16, 0u);
  for (std::int64_t h = 0; h < s.heads; ++h) {
    const std::uint16_t* row = base + h * q.q_head_stride;
    const std::uint16_t* rrow = s.rope_dim ? rope + h * q.q_rope_head_stride : nullptr;
    auto at = [&](std::int64_t i) -> std::uint32_t { return i < s.dim ? row[i] : i < s.qk_dim() ? rrow[i - s.dim] : 0; };
    for (std::int64_t p = 0; p < pairs; ++p)
      qb[((p / 16 * sd.groups + h / 16) * 16 + p % 16) * 16 + h % 16] = at(2 * p) | at(2 * p + 1) << 16;
  }
}

// Key rows [first, first + n) as bf16 rows of dp32 dims, zero rows up to a multiple of 16.
void gather_keys_bf16(const Shape& s, const ScoreDims& sd, const KeyRows& keys, std::int64_t first, std::int64_t n,
                      std::uint16_t* kb) {
  const std::int64_t rows = (n + 15) / 16 * 16;
  for (std::int64_t k = 0; k < rows; ++k) {
    std::uint16_t* row = kb + k * sd.dp32;
    if (k < n) {
      prefetch_key_row(s, keys, first + k + kPrefetchRows);
      copy_key_row(s, keys, first + k, sd.dp32, reinterpret_cast<char*>(row));
    } else {
      std::memset(row, 0, sd.dp32 * 2);
    }
  }
}
#else
// The query row as fp32 rows [hp][dp] (padding zero) and, where `cols` is given, its transpose [dp][hp].
void pack_query(const Shape& s, const Dims& d, const QueryRow& q, float* rows, float* cols) {
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t h = 0; h < d.hp; ++h) {
    float* row = rows + h * d.dp;
    if (h < s.heads) {
      to_float(q.q + h * q.q_head_stride * es, s.dtype, s.dim, s.dim, row);
      to_float(s.rope_dim ? q.q_rope + h * q.q_rope_head_stride * es : nullptr, s.dtype, s.rope_dim,
               d.dp - s.dim, row + s.dim);
    } else {
      std::fill(row, row + d.dp, 0.0f);
    }
  }
  if (cols) transpose(rows, d.dp, d.hp, d.dp, cols, d.hp);
}

// grad_out as fp32 rows [hp][dvp] and, where `cols` is given, its transpose [dvp][hp].
void pack_grad_out(const Shape& s, const Dims& d, const RowBackward& r, float* rows, float* cols) {
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t h = 0; h < d.hp; ++h) {
    float* row = rows + h * d.dvp;
    if (h < s.heads) to_float(r.grad_out + h * r.go_head_stride * es, s.dtype, s.d_v, d.dvp, row);
    else std::fill(row, row + d.dvp, 0.0f);
  }
  if (cols) transpose(rows, d.dvp, d.hp, d.dvp, cols, d.hp);
}

// Key rows [first, first + n) of `keys` as fp32 rows of dp dims. Records behind a
// RowDecoder (the decode op's FP8 caches, bf16 kernel dtype) are decoded one at a time,
// straight to fp32 where the decoder can (decode_f32), else into `decoded` (s.dim bf16
// values, stays in L1) and widened from there: decoding a
// whole piece into a buffer first sent ~0.5 MiB per piece through the caches and back,
// and bounded the pieces to 448 keys (2-5 % slower on a Zen 1 class AVX2 EPYC).
// The backward passes no buffer: its keys are tensors, never behind a decoder.
void load_keys(const Shape& s, const Dims& d, const KeyRows& keys, std::int64_t first, std::int64_t n, float* dst,
               std::uint16_t* decoded) {
  assert(decoded || !keys.decoder);
  for (std::int64_t k = 0; k < n; ++k) {
    prefetch_key_row(s, keys, first + k + kPrefetchRows);
    float* row = dst + k * d.dp;
    const char* main = keys.main[first + k];
    if (keys.decoder && keys.decoder->decode_f32) {
      keys.decoder->decode_f32(keys.decoder->context, first + k, row);
    } else {
      if (keys.decoder) {  // then s.dtype is bf16, what the decoder writes
        keys.decoder->decode(keys.decoder->context, first + k, decoded);
        main = reinterpret_cast<const char*>(decoded);
      }
      to_float(main, s.dtype, s.dim, s.dim, row);
    }
    to_float(s.rope_dim ? keys.rope[first + k] : nullptr, s.dtype, s.rope_dim, d.dp - s.dim, row + s.dim);
  }
}

// Softmax constants padded to hp heads: padded heads behave as empty (p = 0).
void load_constants(const Shape& s, const Dims& d, const RowBackward& row, float* mx, float* cf, float* dl) {
  for (std::int64_t h = 0; h < d.hp; ++h) {
    const bool real = h < s.heads;
    mx[h] = real ? row.max[h] : core::kNegInf;
    cf[h] = real ? row.coef[h] : 0.0f;
    dl[h] = real ? row.delta[h] : 0.0f;
  }
}
#endif

// Scratch carving: 64-byte aligned pieces.
struct Carver {
  char* p;
  template <class T>
  T* take(std::int64_t count) {
    char* at = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(p) + 63) & ~std::uintptr_t(63));
    p = at + count * sizeof(T);
    return reinterpret_cast<T*>(at);
  }
};

// One token's distinct key rows in an owner block. An index list may name a key
// more than once, and two C rows of one product must not alias, so both dkv passes
// run one product row per distinct key: the kept-weights pass sums the entries'
// kept rows into it (`place`), the recompute pass weights it by its count (`count`).
// Per block row: its count (uint32: a list may repeat one key more than 2^16 times)
// and place, and the list of rows (uint16: owner_rows <= kMaxOwnerBlock < 2^16).
// Counts are zero between tokens: `clear` resets only the rows the token touched.
class DistinctKeys {
 public:
  static std::int64_t scratch_words(std::int64_t owner_rows) { return 2 * owner_rows; }  // 4-byte words
  DistinctKeys(std::uint32_t* scratch, std::int64_t owner_rows)
      : count_(scratch),
        unique_(reinterpret_cast<std::uint16_t*>(scratch + owner_rows)),
        place_(unique_ + owner_rows) {
    std::fill(count_, count_ + owner_rows, 0u);
  }
  // The token's distinct rows, in first-listed order; returns how many.
  std::int64_t collect(const TokenEntries& tok) {
    n_ = 0;
    for (std::int64_t e = 0; e < tok.count; ++e) {
      const std::uint16_t r = tok.offsets[e];
      if (count_[r]++ == 0) {
        place_[r] = static_cast<std::uint16_t>(n_);
        unique_[n_++] = r;
      }
    }
    return n_;
  }
  // Rows in ascending order (the recompute pass reads key rows: in order, they stream);
  // `place` no longer holds after it.
  void sort() { std::sort(unique_, unique_ + n_); }
  std::uint16_t row(std::int64_t u) const { return unique_[u]; }
  std::int64_t place(std::int64_t r) const { return place_[r]; }
  float count(std::int64_t r) const { return static_cast<float>(count_[r]); }
  void clear() {
    for (std::int64_t u = 0; u < n_; ++u) count_[unique_[u]] = 0;
  }

 private:
  std::uint32_t* count_;
  std::uint16_t *unique_, *place_;
  std::int64_t n_ = 0;
};

std::size_t fma_scratch_bytes(const Shape& s) {
  const Dims d(s);
  const std::int64_t H = d.hp;
#if defined(DSA_FMA_BF16_SCORES)
  // Q^T pairs and the key block in bf16 (dp32 / 2 floats a row), the value rows in fp32.
  const std::int64_t dp32 = ScoreDims(s).dp32;
  const std::int64_t forward = (H + kBlock) * dp32 / 2 + kBlock * d.dvp + kBlock * H + H * d.dvp + 3 * H;
#else
  const std::int64_t forward = 2 * H * d.dp + kBlock * d.dp + kBlock * H + H * d.dvp + 3 * H + (d.dp + 1) / 2;
#endif
  const std::int64_t query_pass = 2 * H * d.dp + H * d.dvp + kBlock * d.dp + 2 * kBlock * H + H * d.dp + 3 * H;
  // The block's keys and sums (kept weights: merged P and dS rows of a token's
  // repeated entries where the keys would be), ...
  const std::int64_t key_pass = s.owner_rows * std::max(d.dp, 2 * H) + s.owner_rows * d.dp + 2 * H * d.dp +
                                2 * H * d.dvp + 2 * kBlock * H + 3 * H +
                                DistinctKeys::scratch_words(s.owner_rows);  // 4-byte words, as floats
  const std::int64_t floats = std::max({forward, query_pass, key_pass});
  return static_cast<std::size_t>(floats) * 4 + 2 * pointer_count(d) * sizeof(float*) + 16 * 64;
}

// Kept weights: a row's P^T then its scale * dS^T, [kept_keys][hp] each, in fp32
// (the fp32 FMA products' operands as they were computed).
std::size_t fma_packed_row_bytes(const Shape& s) {
  return static_cast<std::size_t>(2 * s.kept_keys * Dims(s).hp) * sizeof(float);
}

// Row pointers base + i * stride for i < n.
void rows_of(float* base, std::int64_t stride, std::int64_t n, float** out) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = base + i * stride;
}

// ---------------------------------------------------------------------------

void fma_forward_row(const Shape& s, const float* sinks, const QueryRow& query, const KeyRows& keys, void* scratch,
                     void* out, float* max_out, float* sum_out) {
  const Dims d(s);
  Carver c{static_cast<char*>(scratch)};
#if defined(DSA_FMA_BF16_SCORES)
  const ScoreDims sd(s);
  auto* qb = c.take<std::uint32_t>(sd.dp32 / 2 * d.hp);
  auto* kb16 = c.take<std::uint16_t>(kBlock * sd.dp32);
  const std::int64_t v_stride = d.dvp;  // kb: the value dims only, for P.V
  float* kb = c.take<float>(kBlock * v_stride);
  pack_query_pairs(s, sd, query, qb);
#else
  float* qrows = c.take<float>(d.hp * d.dp);
  float* qt = c.take<float>(d.dp * d.hp);
  const std::int64_t v_stride = d.dp;  // kb: whole keys, whose first d_v dims are the values
  float* kb = c.take<float>(kBlock * v_stride);
  auto* decoded = c.take<std::uint16_t>(d.dp);  // one decoded record (load_keys)
  pack_query(s, d, query, qrows, qt);
#endif
  float* st = c.take<float>(kBlock * d.hp);
  float* o = c.take<float>(d.hp * d.dvp);
  float* ref = c.take<float>(d.hp);
  float* true_max = c.take<float>(d.hp);
  float* sum = c.take<float>(d.hp);
  float** arow = c.take<float*>(pointer_count(d));
  float** crow = c.take<float*>(pointer_count(d));
  std::fill(o, o + d.hp * d.dvp, 0.0f);
  std::fill(ref, ref + d.hp, core::kNegInf);
  std::fill(true_max, true_max + d.hp, core::kNegInf);
  std::fill(sum, sum + d.hp, 0.0f);
  const Vec scale = vset(s.scale);
  for (std::int64_t first = 0; first < keys.count; first += kBlock) {
    const std::int64_t n = std::min(kBlock, keys.count - first);
#if defined(DSA_FMA_BF16_SCORES)
    // S^T = Kb . Q^T (A = the bf16 key rows as they are: their dims come in pairs)
    gather_keys_bf16(s, sd, keys, first, n, kb16);
    const avx512bf16::PairGemm scores{st, d.hp, 16, kb16, sd.dp32, 32, avx512bf16::as_bf16(qb), 32,
                                      sd.groups * 512, 512, sd.chunks};
    avx512bf16::gemm(false, scores, (n + 15) / 16 * 16, sd.groups);
    for (std::int64_t k = 0; k < n; ++k)
      to_float(reinterpret_cast<const char*>(kb16 + k * sd.dp32), s.dtype, s.d_v, d.dvp, kb + k * d.dvp);
#else
    load_keys(s, d, keys, first, n, kb, decoded);
    // S^T = Kb . Q^T
    rows_of(kb, d.dp, n, arow);
    rows_of(st, d.hp, n, crow);
    gemm(n, d.hp, d.dp, arow, 1, qt, d.hp, crow, false);
#endif
    // Online softmax, kLanes heads per vector.
    for (std::int64_t g = 0; g < d.hp; g += kLanes) {
      Vec block_max = vset(core::kNegInf);
      for (std::int64_t k = 0; k < n; ++k) {
        float* row = st + k * d.hp + g;
        const Vec v = vmul(vload(row), scale);
        vstore(row, v);
        block_max = vmax(v, block_max);  // NaN left out, as std::max in the reference
      }
      alignas(64) float bm[kLanes];
      vstore(bm, block_max);
      for (int l = 0; l < kLanes; ++l) {
        const std::int64_t h = g + l;
        true_max[h] = std::max(true_max[h], bm[l]);
        if (bm[l] > ref[h] + kLazy || (ref[h] == core::kNegInf && bm[l] != core::kNegInf)) {
          const float alpha = ref[h] == core::kNegInf ? 0.0f : std::exp(ref[h] - bm[l]);
          sum[h] *= alpha;
          float* orow = o + h * d.dvp;
          for (std::int64_t x = 0; x < d.dvp; x += kLanes) vstore(orow + x, vmul(vload(orow + x), vset(alpha)));
          ref[h] = bm[l];
        }
      }
      const Vec r = vload(ref + g);
      Vec block_sum = vzero();
      for (std::int64_t k = 0; k < n; ++k) {
        float* row = st + k * d.hp + g;
        const Vec p = vlive(r, vexp(vsub(vload(row), r)));
        vstore(row, p);
        block_sum = vadd(block_sum, p);
      }
      vstore(sum + g, vadd(vload(sum + g), block_sum));
    }
    // O += P . V: A(h, k) = P^T[k][h].
    rows_of(st, 1, d.hp, arow);
    rows_of(o, d.dvp, d.hp, crow);
    gemm(d.hp, d.dvp, n, arow, d.hp, kb, v_stride, crow, true);
  }
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t h = 0; h < s.heads; ++h) {
    const float m = true_max[h];
    float* orow = o + h * d.dvp;
    const float f = finish_head(m, ref[h], sum[h], sinks, h, keys.count, max_out, sum_out);
    for (std::int64_t x = 0; x < s.d_v; ++x) orow[x] *= f;
    if (s.out_fp32) std::memcpy(static_cast<float*>(out) + h * s.d_v, orow, s.d_v * sizeof(float));
    else from_float(orow, s.dtype, s.d_v, static_cast<char*>(out) + h * s.d_v * es);
  }
}

#if !defined(DSA_FMA_BF16_SCORES)  // that build is a forward only
// p = exp(scale * s - max) * coef and ds = p * (dp - delta), kLanes heads at a time;
// both exactly 0 for a head with max -inf, even where dp is NaN (a NaN key).
inline void softmax_grad(Vec sv, Vec dpv, Vec scale, Vec mx, Vec cf, Vec dl, Vec& p, Vec& ds) {
  p = vlive(mx, vmul(vexp(vsub(vmul(sv, scale), mx)), cf));
  ds = vlive(mx, vmul(p, vsub(dpv, dl)));
}

// A head with max -inf (an empty row, or keys whose logits are all NaN) adds
// to no gradient: the reference skips it. Its weights are 0 here, and these
// rows of its query and grad_out are zeroed so that no 0 * NaN reaches dK / dV.
void zero_dead_heads(const Shape& s, const Dims& d, const float* mx, float* qrows, float* grows) {
  for (std::int64_t h = 0; h < s.heads; ++h)
    if (mx[h] == core::kNegInf) {
      std::fill(qrows + h * d.dp, qrows + (h + 1) * d.dp, 0.0f);
      std::fill(grows + h * d.dvp, grows + (h + 1) * d.dvp, 0.0f);
    }
}

void fma_backward_query_row(const Shape& s, const QueryRow& query, const RowBackward& row, const KeyRows& keys,
                            void* scratch, void* d_query, void* d_query_rope) {
  const Dims d(s);
  Carver c{static_cast<char*>(scratch)};
  float* qrows = c.take<float>(d.hp * d.dp);
  float* qt = c.take<float>(d.dp * d.hp);
  float* gt = c.take<float>(d.dvp * d.hp);
  float* kb = c.take<float>(kBlock * d.dp);
  float* st = c.take<float>(kBlock * d.hp);
  float* dpt = c.take<float>(kBlock * d.hp);
  float* dq = c.take<float>(d.hp * d.dp);
  float* mx = c.take<float>(d.hp);
  float* cf = c.take<float>(d.hp);
  float* dl = c.take<float>(d.hp);
  float** arow = c.take<float*>(pointer_count(d));
  float** crow = c.take<float*>(pointer_count(d));
  pack_query(s, d, query, qrows, qt);
  pack_grad_out(s, d, row, dq, gt);  // dq doubles as the grad_out rows until it is zeroed
  load_constants(s, d, row, mx, cf, dl);
  std::fill(dq, dq + d.hp * d.dp, 0.0f);
  const Vec scale = vset(s.scale);
  for (std::int64_t first = 0; first < keys.count; first += kBlock) {
    const std::int64_t n = std::min(kBlock, keys.count - first);
    load_keys(s, d, keys, first, n, kb, /*decoded=*/nullptr);
    rows_of(kb, d.dp, n, arow);
    rows_of(st, d.hp, n, crow);
    gemm(n, d.hp, d.dp, arow, 1, qt, d.hp, crow, false);  // S^T
    rows_of(dpt, d.hp, n, crow);
    gemm(n, d.hp, d.dvp, arow, 1, gt, d.hp, crow, false);  // dP^T (dO^T rows past d_v are zero)
    float* kept_p = s.kept_keys ? static_cast<float*>(row.packed) + first * d.hp : nullptr;
    float* kept_ds = kept_p ? kept_p + s.kept_keys * d.hp : nullptr;
    for (std::int64_t g = 0; g < d.hp; g += kLanes) {
      const Vec m = vload(mx + g), f = vload(cf + g), de = vload(dl + g);
      for (std::int64_t k = 0; k < n; ++k) {
        Vec p, ds;
        softmax_grad(vload(st + k * d.hp + g), vload(dpt + k * d.hp + g), scale, m, f, de, p, ds);
        vstore(st + k * d.hp + g, ds);
        if (kept_p) {  // for the dkv pass (fma_backward_key_block_kept)
          vstore(kept_p + k * d.hp + g, p);
          vstore(kept_ds + k * d.hp + g, vmul(ds, scale));
        }
      }
    }
    // dQ += dS . Kb: A(h, k) = dS^T[k][h].
    rows_of(st, 1, d.hp, arow);
    rows_of(dq, d.dp, d.hp, crow);
    gemm(d.hp, d.dp, n, arow, d.hp, kb, d.dp, crow, true);
  }
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t h = 0; h < s.heads; ++h) {
    float* acc = dq + h * d.dp;
    if (mx[h] == core::kNegInf) std::fill(acc, acc + s.qk_dim(), 0.0f);  // dS 0 met NaN keys (zero_dead_heads)
    for (std::int64_t k = 0; k < s.qk_dim(); ++k) acc[k] *= s.scale;
    from_float(acc, s.dtype, s.dim, static_cast<char*>(d_query) + h * s.dim * es);
    if (s.rope_dim) from_float(acc + s.dim, s.dtype, s.rope_dim, static_cast<char*>(d_query_rope) + h * s.rope_dim * es);
  }
}

// The block's fp32 sums `acc` [count][dp] to d_main / d_rope, or back to `partial`.
void finish_key_block(const Shape& s, const Dims& d, const float* acc, std::int64_t count, float* partial,
                      void* d_main, void* d_rope) {
  if (keep_block_sums(s, acc, count, d.dp, partial)) return;
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t k = 0; k < count; ++k) {
    from_float(acc + k * d.dp, s.dtype, s.dim, static_cast<char*>(d_main) + k * s.dim * es);
    if (s.rope_dim) from_float(acc + k * d.dp + s.dim, s.dtype, s.rope_dim, static_cast<char*>(d_rope) + k * s.rope_dim * es);
  }
}

// The dkv pass on the weights the dq pass kept (Shape::kept_keys): per token,
// dK rows += dS^T . Q and dV rows += P^T . dO with A rows read in place from
// the token's packed P^T and dS^T. The block's keys are never loaded. A key the
// token lists more than once (an index list with repeats) gets one row, the sum
// of its entries' rows (DistinctKeys).
void fma_backward_key_block_kept(const Shape& s, const KeyRows& block, const TokenEntries* tokens,
                                 std::int64_t n_tokens, void* scratch, float* partial, void* d_main, void* d_rope) {
  const Dims d(s);
  Carver c{static_cast<char*>(scratch)};
  float* merged = c.take<float>(s.owner_rows * std::max(d.dp, 2 * d.hp));  // P^T rows, then dS^T rows
  float* acc = c.take<float>(s.owner_rows * d.dp);
  float* qrows = c.take<float>(d.hp * d.dp);
  float* grows = c.take<float>(d.hp * d.dvp);
  float* mx = c.take<float>(d.hp);
  float* cf = c.take<float>(d.hp);
  float* dl = c.take<float>(d.hp);
  DistinctKeys keys(c.take<std::uint32_t>(DistinctKeys::scratch_words(s.owner_rows)), s.owner_rows);
  const float** arow = c.take<const float*>(pointer_count(d));
  float** crow = c.take<float*>(pointer_count(d));
  start_block_sums(s, partial, block.count, block.count, d.dp, acc);
  float* merged_ds = merged + s.owner_rows * d.hp;
  for (std::int64_t t = 0; t < n_tokens; ++t) {
    const TokenEntries& tok = tokens[t];
    assert(tok.slots && tok.row.packed);
    const std::int64_t n_unique = keys.collect(tok);
    pack_query(s, d, tok.query, qrows, nullptr);
    pack_grad_out(s, d, tok.row, grows, nullptr);
    load_constants(s, d, tok.row, mx, cf, dl);
    zero_dead_heads(s, d, mx, qrows, grows);
    const float* kept_p = static_cast<const float*>(tok.row.packed);
    const float* kept_ds = kept_p + s.kept_keys * d.hp;
    const bool repeats = n_unique < tok.count;
    if (repeats) {
      std::fill(merged, merged + n_unique * d.hp, 0.0f);
      std::fill(merged_ds, merged_ds + n_unique * d.hp, 0.0f);
      for (std::int64_t e = 0; e < tok.count; ++e) {
        const std::int64_t u = keys.place(tok.offsets[e]), slot = tok.slots[e];
        for (std::int64_t h = 0; h < d.hp; h += kLanes) {
          vstore(merged + u * d.hp + h, vadd(vload(merged + u * d.hp + h), vload(kept_p + slot * d.hp + h)));
          vstore(merged_ds + u * d.hp + h, vadd(vload(merged_ds + u * d.hp + h), vload(kept_ds + slot * d.hp + h)));
        }
      }
    }
    // Entry e's A rows: its kept rows, or its merged rows (then e runs over `unique`).
    const std::int64_t entries = repeats ? n_unique : tok.count;
    for (std::int64_t first = 0; first < entries; first += kBlock) {
      const std::int64_t n = std::min(kBlock, entries - first);
      for (std::int64_t e = 0; e < n; ++e) {
        const std::int64_t x = first + e;
        crow[e] = acc + (repeats ? keys.row(x) : tok.offsets[x]) * d.dp;
        arow[e] = repeats ? merged_ds + x * d.hp : kept_ds + tok.slots[x] * d.hp;
      }
      gemm(n, d.dp, d.hp, arow, 1, qrows, d.dp, crow, true);  // dK rows += dS^T . Q
      for (std::int64_t e = 0; e < n; ++e) {
        const std::int64_t x = first + e;
        arow[e] = repeats ? merged + x * d.hp : kept_p + tok.slots[x] * d.hp;
      }
      gemm(n, d.dvp, d.hp, arow, 1, grows, d.dvp, crow, true);  // dV rows += P^T . dO
    }
    keys.clear();
  }
  finish_key_block(s, d, acc, block.count, partial, d_main, d_rope);
}

void fma_backward_key_block(const Shape& s, const KeyRows& block, const TokenEntries* tokens, std::int64_t n_tokens,
                            void* scratch, float* partial, void* d_main, void* d_rope) {
  if (s.kept_keys) return fma_backward_key_block_kept(s, block, tokens, n_tokens, scratch, partial, d_main, d_rope);
  const Dims d(s);
  Carver c{static_cast<char*>(scratch)};
  float* kbb = c.take<float>(s.owner_rows * d.dp);
  float* acc = c.take<float>(s.owner_rows * d.dp);
  float* qrows = c.take<float>(d.hp * d.dp);
  float* qt = c.take<float>(d.dp * d.hp);
  float* grows = c.take<float>(d.hp * d.dvp);
  float* gt = c.take<float>(d.dvp * d.hp);
  float* st = c.take<float>(kBlock * d.hp);
  float* dpt = c.take<float>(kBlock * d.hp);
  float* mx = c.take<float>(d.hp);
  float* cf = c.take<float>(d.hp);
  float* dl = c.take<float>(d.hp);
  DistinctKeys keys(c.take<std::uint32_t>(DistinctKeys::scratch_words(s.owner_rows)), s.owner_rows);
  float** arow = c.take<float*>(pointer_count(d));
  float** crow = c.take<float*>(pointer_count(d));
  load_keys(s, d, block, 0, block.count, kbb, /*decoded=*/nullptr);
  start_block_sums(s, partial, block.count, block.count, d.dp, acc);
  const Vec scale = vset(s.scale);
  for (std::int64_t t = 0; t < n_tokens; ++t) {
    const TokenEntries& tok = tokens[t];
    // A key the token lists twice contributes twice: once, with weight 2.
    const std::int64_t n_unique = keys.collect(tok);
    keys.sort();
    pack_query(s, d, tok.query, qrows, qt);
    pack_grad_out(s, d, tok.row, grows, gt);
    load_constants(s, d, tok.row, mx, cf, dl);
    zero_dead_heads(s, d, mx, qrows, grows);
    for (std::int64_t first = 0; first < n_unique; first += kBlock) {
      const std::int64_t n = std::min(kBlock, n_unique - first);
      for (std::int64_t e = 0; e < n; ++e) arow[e] = kbb + keys.row(first + e) * d.dp;
      rows_of(st, d.hp, n, crow);
      gemm(n, d.hp, d.dp, arow, 1, qt, d.hp, crow, false);  // S^T
      rows_of(dpt, d.hp, n, crow);
      gemm(n, d.hp, d.dvp, arow, 1, gt, d.hp, crow, false);  // dP^T
      for (std::int64_t e = 0; e < n; ++e) {
        const float w = keys.count(keys.row(first + e));
        const Vec vw = vset(w), vws = vset(w * s.scale);
        for (std::int64_t g = 0; g < d.hp; g += kLanes) {
          Vec p, ds;
          softmax_grad(vload(st + e * d.hp + g), vload(dpt + e * d.hp + g), scale, vload(mx + g), vload(cf + g),
                       vload(dl + g), p, ds);
          vstore(st + e * d.hp + g, vmul(p, vw));      // P^T row, weighted
          vstore(dpt + e * d.hp + g, vmul(ds, vws));   // dS^T row, weighted, with the logit scale
        }
      }
      // dK rows += dS^T . Q (all dims), dV rows += P^T . dO (value dims).
      for (std::int64_t e = 0; e < n; ++e) crow[e] = acc + keys.row(first + e) * d.dp;
      rows_of(dpt, d.hp, n, arow);
      gemm(n, d.dp, d.hp, arow, 1, qrows, d.dp, crow, true);
      rows_of(st, d.hp, n, arow);
      gemm(n, d.dvp, d.hp, arow, 1, grows, d.dvp, crow, true);
    }
    keys.clear();
  }
  finish_key_block(s, d, acc, block.count, partial, d_main, d_rope);
}

#endif  // !DSA_FMA_BF16_SCORES

}  // namespace

#if defined(DSA_FMA_BF16_SCORES)
// The driver runs the bf16 backward of these CPUs on the pair kernels
// (avx512_bf16_kernel()); the entries here are the plain AVX-512 ones.
const AttentionKernel& DSA_FMA_KERNEL_NAME() {
  static const AttentionKernel kernel{DSA_FMA_KERNEL_LABEL, fma_scratch_bytes, fma_packed_row_bytes, fma_forward_row,
                                      avx512_kernel().backward_query_row, avx512_kernel().backward_key_block};
  return kernel;
}
#else
const AttentionKernel& DSA_FMA_KERNEL_NAME() {
  static const AttentionKernel kernel{DSA_FMA_KERNEL_LABEL,   fma_scratch_bytes,      fma_packed_row_bytes,
                                      fma_forward_row,        fma_backward_query_row, fma_backward_key_block,
                                      /*decodes_rows=*/true,  /*keeps_weights=*/true};
  return kernel;
}
#endif

}  // namespace dsa::cpu::attention_kernels
