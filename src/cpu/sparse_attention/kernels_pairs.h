// Attention kernels on bf16 pairs (bf16 inputs): every GEMM of the forward and
// of both backward passes is a product of bf16 operands in the pair (VNNI)
// layout with fp32 accumulation; softmax and its gradient in fp32 AVX-512.
// Included by kernels_amx.cpp (the products on AMX tiles) and by
// kernels_avx512bf16.cpp (the same products with AVX-512-BF16 vdpbf16ps), which
// define, before including this file, inside this anonymous namespace:
//   void configure_tiles();   per-thread set-up at every kernel entry
//   void tile_gemm2(...);     the product contract below ("Products")
//   constexpr std::int64_t kDenseSubBlockPercent;  see the dkv pass
// and name the kernel through DSA_PAIR_KERNEL_NAME / DSA_PAIR_KERNEL_LABEL.
// One algorithm, two engines: the packing, softmax and the order of every
// accumulation are shared, so both engines see the same operands.
//
// Forward, per query row (all heads of one token), per block of kBlock keys:
//   1. gather the keys' rows into a contiguous bf16 block Kb [kBlock][Dp]
//      (Dp = qk dims padded to 32) and interleave their value dims into the
//      VNNI pair layout Vv [dv/16][kBlock/2][16][2] that B tiles of P.V want;
//   2. S^T [keys][heads] = Kb . Q^T: A tiles straight from Kb (rows = keys),
//      B tiles from the query packed once per row in VNNI pairs of dims.
//      Computing S^T rather than S keeps the gathered keys as A (no transpose
//      of the wide key rows); only the small [keys][heads] block is transposed;
//   3. online softmax in fp32, vectorised over heads, with a lazily updated
//      reference max (rescale only when the max grows by more than kLazy, so
//      the [heads][d_v] accumulator is rarely touched); P is transposed to
//      [heads][keys] as two bf16 parts, Ph = bf16(P) and Pl = bf16(P - Ph),
//      the A tiles of
//   4. O [heads][d_v] += Ph . V + Pl . V, accumulated in an fp32 buffer (P in
//      bf16 alone cost a bf16 model measurable gradient accuracy).
//
// Products: tile_gemm2 computes
// C [m_tiles * 16][n_groups * 16] (+)= A . B with the contraction in chunks of
// 32 bf16 (VNNI pairs). A tile (mt, kc) at a + mt*16*a_stride + kc*32 (row
// stride a_stride elements); B tile (kc, ng) at b + kc*b_chunk + ng*b_group
// (row stride b_stride elements: one row is 16 columns x 2 bf16 of a pair of
// contraction indices); C tile (mt, ng) at c + mt*16*c_stride + ng*16.
// A second product A2 . B2 (same strides as the first, k2_chunks deep) is
// added to the column groups ng < n2_groups while their C tiles are resident:
// the dkv pass adds its value part P^T.dO to the key part dS^T.Q that way, and
// the forward Pl . V to Ph . V. Where a LineDrip is given (the last argument,
// optional), the product paces its prefetches over its steps (cpu/isa/line_drip.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "cpu/isa/avx512.h"
#include "cpu/isa/fma.h"
#include "cpu/isa/line_drip.h"
#include "cpu/sparse_attention/attention_kernels.h"

namespace dsa::cpu::attention_kernels {
namespace {

constexpr std::int64_t kBlock = 128;  // keys per block: four 32-key chunks of P.V per C tile load
constexpr float kLazy = 8.0f;        // exp(8) ~ 3e3: P stays far from bf16 / fp32 limits

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

// Pair operands that are the B of a product over many column groups (P.V,
// dS.K, dS^T.Q, P^T.dO) are stored in panels of 16 columns:
// [cols_pad / 16][pairs][16][2], so the B rows one register block reads are
// contiguous. A [pairs][cols_pad][2] layout put them 2 KiB apart at d_v = 512,
// onto a few L1 sets, and B came from L2 for every block of C rows (P.V ran at
// 55% of the vdpbf16ps peak instead of 76%). Each panel is padded by one
// line: at a multiple of 4 KiB the interleave's stores into the panels alias
// its own loads (measured: the forward's gather took 5% more of the time).
constexpr std::int64_t panel_stride(std::int64_t pairs) { return pairs * 32 + 32; }
// bf16 elements of a paneled operand of cols_pad columns (a multiple of 16).
constexpr std::int64_t paneled_elements(std::int64_t cols_pad, std::int64_t pairs) {
  return cols_pad / 16 * panel_stride(pairs);
}

void tile_gemm(bool accumulate, float* c, std::int64_t c_stride, std::int64_t m_tiles, std::int64_t n_groups,
               const std::uint16_t* a, std::int64_t a_stride, const std::uint16_t* b, std::int64_t b_stride,
               std::int64_t b_chunk, std::int64_t b_group, std::int64_t k_chunks, LineDrip* drip = nullptr) {
  tile_gemm2(accumulate, c, c_stride, m_tiles, n_groups, a, a_stride, b, b_stride, b_chunk, b_group, k_chunks, 0,
             nullptr, nullptr, 0, 0, 0, drip);
}

struct Dims {
  std::int64_t hp, dp, dvp, groups, chunks, dv_groups;
  explicit Dims(const Shape& s)
      : hp(round_up(s.heads, 16)), dp(round_up(s.qk_dim(), 32)), dvp(round_up(s.d_v, 16)),
        groups(hp / 16), chunks(dp / 32), dv_groups(dvp / 16) {}
};

struct Buffers {
  std::uint16_t* qrow;  // [hp][dp]
  std::uint16_t* qb;  // [chunks][groups][16 pairs][16 heads][2]
  std::uint16_t* kb;  // [kBlock][dp]
  std::uint16_t* vv;  // [dvp / 16][kBlock / 2][16][2]
  std::uint16_t* pa;  // [hp][kBlock] P rounded to bf16
  std::uint16_t* pl;  // [hp][kBlock] P - pa, rounded to bf16 (see pair_forward_row)
  float* s;           // [kBlock][hp]
  float* o;           // [hp][dvp]
  float* max;         // [hp] reference max the block sums are relative to
  float* true_max;    // [hp]
  float* sum;         // [hp]
};

std::size_t forward_bytes(const Dims& d) {
  return static_cast<std::size_t>(2 * d.dp * d.hp * 2 + kBlock * d.dp * 2 + paneled_elements(d.dvp, kBlock / 2) * 2 +
                                  2 * d.hp * kBlock * 2 + kBlock * d.hp * 4 + d.hp * d.dvp * 4 + 3 * d.hp * 4) +
         12 * 64;
}

Buffers carve(void* scratch, const Dims& d) {
  auto next = [p = static_cast<char*>(scratch)](std::size_t bytes) mutable {
    char* at = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(p) + 63) & ~std::uintptr_t(63));
    p = at + bytes;
    return at;
  };
  Buffers b;
  b.qrow = reinterpret_cast<std::uint16_t*>(next(d.dp * d.hp * 2));
  b.qb = reinterpret_cast<std::uint16_t*>(next(d.dp * d.hp * 2));
  b.kb = reinterpret_cast<std::uint16_t*>(next(kBlock * d.dp * 2));
  b.vv = reinterpret_cast<std::uint16_t*>(next(paneled_elements(d.dvp, kBlock / 2) * 2));
  b.pa = reinterpret_cast<std::uint16_t*>(next(d.hp * kBlock * 2));
  b.pl = reinterpret_cast<std::uint16_t*>(next(d.hp * kBlock * 2));
  b.s = reinterpret_cast<float*>(next(kBlock * d.hp * 4));
  b.o = reinterpret_cast<float*>(next(d.hp * d.dvp * 4));
  b.max = reinterpret_cast<float*>(next(d.hp * 4));
  b.true_max = reinterpret_cast<float*>(next(d.hp * 4));
  b.sum = reinterpret_cast<float*>(next(d.hp * 4));
  return b;
}

std::size_t row_scratch_bytes(const struct BackwardDims& d);
std::size_t block_scratch_bytes(const struct BackwardDims& d, std::int64_t owner_rows);
std::size_t pair_scratch_bytes(const Shape& s);

// exp for the softmax (inputs are <= kLazy above the reference max): the FMA
// kernels' fma::vexp on zmm, so both kernel families weigh a logit alike.
inline __m512 exp512(__m512 x) { return fma::vexp(x); }

// cols[c][r] = src[r][c] for a 16 x 16 block of 32-bit elements (pure data
// movement, so it serves fp32 values and bf16 pairs alike).
inline void transpose16(const float* src, std::int64_t src_stride, __m512 cols[16]) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(_mm512_loadu_ps(src + i * src_stride));
  avx512::transpose16x16(r);
  for (int i = 0; i < 16; ++i) cols[i] = _mm512_castsi512_ps(r[i]);
}

// dst[c][r] = src[r][c] for a 16 x 16 fp32 block, written as bf16.
inline void transpose16_to_bf16(const float* src, std::int64_t src_stride, std::uint16_t* dst,
                                std::int64_t dst_stride) {
  __m512 cols[16];
  transpose16(src, src_stride, cols);
  for (int c = 0; c < 16; ++c)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * dst_stride), (__m256i)_mm512_cvtneps_pbh(cols[c]));
}

// As transpose16_to_bf16, and the remainders src - hi rounded to bf16 into lo:
// hi + lo holds each value to about 2^-16 of it.
inline void transpose16_to_bf16_split(const float* src, std::int64_t src_stride, std::uint16_t* hi,
                                      std::uint16_t* lo, std::int64_t dst_stride) {
  __m512 cols[16];
  transpose16(src, src_stride, cols);
  for (int c = 0; c < 16; ++c) {
    const __m256bh h = _mm512_cvtneps_pbh(cols[c]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + c * dst_stride), (__m256i)h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + c * dst_stride),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(cols[c], _mm512_cvtpbh_ps(h))));
  }
}


// rows [>= hp][cols_pad] bf16 (heads x dims) -> B tiles of pairs of dims x 16
// heads: [cols_pad/32][hp/16][16 pairs][16 heads][2], one 16x16 transpose of
// 32-bit pairs per tile.
void pack_dim_pairs(const std::uint16_t* rows, std::int64_t cols_pad, const Dims& d, std::uint16_t* out) {
  __m512 cols[16];
  for (std::int64_t c = 0; c < cols_pad / 32; ++c)
    for (std::int64_t g = 0; g < d.groups; ++g) {
      transpose16(reinterpret_cast<const float*>(rows + g * 16 * cols_pad + c * 32), cols_pad / 2, cols);
      auto* dst = reinterpret_cast<float*>(out + (c * d.groups + g) * 512);
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(dst + r * 16, cols[r]);
    }
}

// Query row -> contiguous [hp][dp] rows (query, rope, zero padding), then the
// B tiles of S^T = K . Q^T: pairs of dims (rows) by 16 heads (cols).
void pack_query(const Shape& s, const Dims& d, const QueryRow& q, std::uint16_t* qrow, std::uint16_t* qb) {
  const auto* base = reinterpret_cast<const std::uint16_t*>(q.q);
  const auto* rope = reinterpret_cast<const std::uint16_t*>(q.q_rope);
  for (std::int64_t h = 0; h < d.hp; ++h) {
    std::uint16_t* row = qrow + h * d.dp;
    if (h < s.heads) {
      std::memcpy(row, base + h * q.q_head_stride, s.dim * 2);
      if (s.rope_dim) std::memcpy(row + s.dim, rope + h * q.q_rope_head_stride, s.rope_dim * 2);
      std::memset(row + s.qk_dim(), 0, (d.dp - s.qk_dim()) * 2);
    } else {
      std::memset(row, 0, d.dp * 2);
    }
  }
  pack_dim_pairs(qrow, d.dp, d, qb);
}

void interleave_rows(const std::uint16_t* a, const std::uint16_t* b, std::int64_t cols, std::int64_t cols_pad,
                     std::uint16_t* out, std::int64_t panel);

// Gathers up to kBlock keys into Kb and the first `vcols` dims of each pair of
// keys into the paneled pair layout Vv [vpad / 16][kBlock / 2][16][2].
//
// prefetch_next (the prefill forward): while copying its key k, also ask for
// key k of the next block, spread over the copy rather than in one burst after
// it (a burst of a block's lines filled the core's miss buffers and stalled it
// until nearly all had arrived). The decode forward spreads the same requests
// over the products instead (Shape::cache_keys).

void gather_block(const Shape& s, const Dims& d, const KeyRows& keys, std::int64_t first, std::int64_t n,
                  std::uint16_t* kb, std::uint16_t* vv, std::int64_t vcols, std::int64_t vpad,
                  bool prefetch_next = false) {
  for (std::int64_t k = 0; k < kBlock; ++k) {
    std::uint16_t* row = kb + k * d.dp;
    if (k < n) {
      prefetch_key_row(s, keys, first + k + kPrefetchRows);
      if (prefetch_next) prefetch_key_row<_MM_HINT_T1>(s, keys, first + kBlock + k);  // into L2, below this block
      copy_key_row(s, keys, first + k, d.dp, reinterpret_cast<char*>(row));
    } else {
      std::memset(row, 0, d.dp * 2);
    }
  }
  const std::int64_t pairs = (n + 1) / 2, panel = panel_stride(kBlock / 2);
  for (std::int64_t pr = 0; pr < kBlock / 2; ++pr) {
    std::uint16_t* out = vv + pr * 32;
    if (pr >= pairs) {
      for (std::int64_t g = 0; g < vpad / 16; ++g) std::memset(out + g * panel, 0, 64);
      continue;
    }
    interleave_rows(kb + 2 * pr * d.dp, kb + (2 * pr + 1) * d.dp, vcols, vpad, out, panel);
  }
}

// One pair row of a paneled operand: column c's pair (a[c], b[c]) at
// out + (c / 16) * panel + (c % 16) * 2, zeros for cols <= c < cols_pad.
void interleave_rows(const std::uint16_t* a, const std::uint16_t* b, std::int64_t cols, std::int64_t cols_pad,
                     std::uint16_t* out, std::int64_t panel) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                          22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  std::int64_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
    _mm512_storeu_si512(out + (c / 16) * panel, _mm512_permutex2var_epi16(va, lo_idx, vb));
    _mm512_storeu_si512(out + (c / 16 + 1) * panel, _mm512_permutex2var_epi16(va, hi_idx, vb));
  }
  for (; c < cols_pad; ++c) {
    std::uint16_t* at = out + (c / 16) * panel + (c % 16) * 2;
    at[0] = c < cols ? a[c] : 0;
    at[1] = c < cols ? b[c] : 0;
  }
}

void pair_forward_row(const Shape& s, const float* sinks, const QueryRow& query, const KeyRows& keys,
                     void* scratch, void* out, float* max_out, float* sum_out) {
  const Dims d(s);
  const Buffers b = carve(scratch, d);
  configure_tiles();
  pack_query(s, d, query, b.qrow, b.qb);
  std::memset(b.o, 0, d.hp * d.dvp * 4);
  for (std::int64_t h = 0; h < d.hp; ++h) {
    b.max[h] = b.true_max[h] = core::kNegInf;
    b.sum[h] = 0.0f;
  }
  const __m512 scale = _mm512_set1_ps(s.scale);

  // Decode: the next block's records are asked for while this block's products
  // run. Before (as prefill still does), during the copy, which stalled on them:
  // H = 16, batch 16 over a huge-page cache 5.5-5.9 -> 4.9-5.0 ms (Zen 4).
  // The decode op's keys are whole records (rope_dim 0): the drip follows main rows only.
  LineDrip next_rows;
  LineDrip* drip = s.cache_keys && s.rope_dim == 0 ? &next_rows : nullptr;
  const std::int64_t pv_parts = s.bf16_p ? 1 : 2;
  for (std::int64_t first = 0; first < keys.count; first += kBlock) {
    const std::int64_t n = std::min(kBlock, keys.count - first);
    gather_block(s, d, keys, first, n, b.kb, b.vv, s.d_v, d.dvp, /*prefetch_next=*/!drip);
    const std::int64_t key_tiles = (n + 15) / 16;
    const std::int64_t next = first + kBlock, n_next = std::clamp<std::int64_t>(keys.count - next, 0, kBlock);
    if (drip) {
      next_rows.reset(keys.main + next, main_row_bytes(s, keys), n_next);
      // The key product's share of the lines: its share of the block's products.
      const std::int64_t qk_work = key_tiles * d.groups * d.chunks,
                         pv_work = d.groups * d.dv_groups * ((n + 31) / 32) * pv_parts;
      next_rows.budget(qk_work, qk_work + pv_work);
    }

    // S^T = Kb . Q^T.
    tile_gemm(false, b.s, d.hp, key_tiles, d.groups, b.kb, d.dp, b.qb, 32, d.groups * 512, 512, d.chunks, drip);

    // Online softmax, 16 heads per vector.
    for (std::int64_t g = 0; g < d.groups; ++g) {
      __m512 block_max = _mm512_set1_ps(core::kNegInf);
      for (std::int64_t k = 0; k < n; ++k) {
        float* row = b.s + k * d.hp + g * 16;
        const __m512 v = _mm512_mul_ps(_mm512_load_ps(row), scale);
        _mm512_store_ps(row, v);
        block_max = _mm512_max_ps(v, block_max);  // NaN left out, as std::max in the reference
      }
      alignas(64) float bm[16];
      _mm512_store_ps(bm, block_max);
      for (int l = 0; l < 16; ++l) {
        const std::int64_t h = g * 16 + l;
        b.true_max[h] = std::max(b.true_max[h], bm[l]);
        if (bm[l] > b.max[h] + kLazy || (b.max[h] == core::kNegInf && bm[l] != core::kNegInf)) {
          const float alpha = b.max[h] == core::kNegInf ? 0.0f : std::exp(b.max[h] - bm[l]);
          b.sum[h] *= alpha;
          float* orow = b.o + h * d.dvp;
          for (std::int64_t c = 0; c < d.dvp; c += 16)
            _mm512_store_ps(orow + c, _mm512_mul_ps(_mm512_load_ps(orow + c), _mm512_set1_ps(alpha)));
          b.max[h] = bm[l];
        }
      }
      // A head whose reference max is still -inf has only -inf logits so far: p = 0.
      const __m512 ref = _mm512_load_ps(b.max + g * 16);
      const __mmask16 live = _mm512_cmp_ps_mask(ref, _mm512_set1_ps(core::kNegInf), _CMP_NEQ_OQ);
      __m512 block_sum = _mm512_setzero_ps();
      for (std::int64_t k = 0; k < kBlock; ++k) {
        float* row = b.s + k * d.hp + g * 16;
        __m512 p = _mm512_setzero_ps();
        if (k < n) p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_load_ps(row), ref)));
        _mm512_store_ps(row, p);
        block_sum = _mm512_add_ps(block_sum, p);
      }
      _mm512_store_ps(b.sum + g * 16, _mm512_add_ps(_mm512_load_ps(b.sum + g * 16), block_sum));
      for (std::int64_t kt = 0; kt < kBlock / 16; ++kt) {
        const float* src = b.s + kt * 16 * d.hp + g * 16;
        std::uint16_t* pa = b.pa + g * 16 * kBlock + kt * 16;
        if (s.bf16_p) transpose16_to_bf16(src, d.hp, pa, kBlock);
        else transpose16_to_bf16_split(src, d.hp, pa, b.pl + g * 16 * kBlock + kt * 16, kBlock);
      }
    }

    // O += P . V with P = pa + pl: P rounded to bf16 alone gave a bf16 model's
    // gradients measurably more error than its own attention (docs/sparse_attention.md).
    // With bf16_p (decode: no gradients) P is pa alone, one product.
    const std::int64_t v_chunks = (n + 31) / 32;
    if (drip) next_rows.budget(1, 1);  // the rest
    tile_gemm2(true, b.o, d.dvp, d.groups, d.dv_groups, b.pa, kBlock, b.vv, 32, 512, panel_stride(kBlock / 2),
               v_chunks, s.bf16_p ? 0 : d.dv_groups, b.pl, b.vv, 32, 512, v_chunks, drip);
  }

  auto* dst = static_cast<std::uint16_t*>(out);
  for (std::int64_t h = 0; h < s.heads; ++h) {
    const float m = b.true_max[h];
    float* orow = b.o + h * d.dvp;
    const float f = finish_head(m, b.max[h], b.sum[h], sinks, h, keys.count, max_out, sum_out);
    std::int64_t c = 0;
    const __m512 vf = _mm512_set1_ps(f);
    if (s.out_fp32) {
      float* dst32 = static_cast<float*>(out) + h * s.d_v;
      for (; c < s.d_v; ++c) dst32[c] = orow[c] * f;
      continue;
    }
    for (; c + 16 <= s.d_v; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + h * s.d_v + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(orow + c), vf)));
    for (; c < s.d_v; ++c) dst[h * s.d_v + c] = core::float_to_bf16(orow[c] * f);
  }
}

// ---------------------------------------------------------------------------
// ---------------------------------------------------------------------------
// Backward.


// Per-row operands packed by the dq pass and reused by the dkv pass:
//   qb1 [dp/32][hp/16][16][16][2]   query, pairs of dims x heads   (B of K.Q^T)
//   db1 [dvq/32][hp/16][16][16][2]  grad_out, pairs of dims x heads (B of V.dO^T)
//   qb2 [dp/16][hq/2][16][2]        query, pairs of heads x dims, paneled   (B of dS^T.Q)
//   db2 [dvp/16][hq/2][16][2]       grad_out, pairs of heads x dims, paneled (B of P^T.dO)
struct BackwardDims : Dims {
  std::int64_t hq, dvq;
  explicit BackwardDims(const Shape& s) : Dims(s), hq(round_up(s.heads, 32)), dvq(round_up(s.d_v, 32)) {}
  std::size_t qb1() const { return dp * hp * 2; }
  std::size_t db1() const { return dvq * hp * 2; }
  std::size_t qb2() const { return paneled_elements(dp, hq / 2) * 2; }
  std::size_t db2() const { return paneled_elements(dvp, hq / 2) * 2; }
  std::size_t packed() const { return round_up(qb1() + db1() + qb2() + db2(), 64); }
};

struct PackedRow {
  std::uint16_t *qb1, *db1, *qb2, *db2;
  PackedRow(void* base, const BackwardDims& d) {
    auto* p = static_cast<std::uint16_t*>(base);
    qb1 = p;
    db1 = qb1 + d.qb1() / 2;
    qb2 = db1 + d.db1() / 2;
    db2 = qb2 + d.qb2() / 2;
  }
};

std::size_t pair_packed_row_bytes(const Shape& s) { return BackwardDims(s).packed(); }

struct RowScratch {
  std::uint16_t* qrow;  // [hq][dp]
  std::uint16_t* drow;  // [hq][dvq]
  std::uint16_t* kb;    // [kBlock][dp]
  std::uint16_t* kv;    // [dp / 16][kBlock / 2][16][2]
  float* s;             // [kBlock][hp]
  float* dpb;           // [kBlock][hp]
  std::uint16_t* dsa;   // [hp][kBlock]
  float* dq;            // [hp][dp]
  float *mx, *cf, *dl;  // [hp]
};

std::size_t row_scratch_bytes(const BackwardDims& d) {
  return static_cast<std::size_t>(d.hq * d.dp * 2 + d.hq * d.dvq * 2 + kBlock * d.dp * 2 +
                                  paneled_elements(d.dp, kBlock / 2) * 2 +
                                  2 * kBlock * d.hp * 4 + d.hp * kBlock * 2 + d.hp * d.dp * 4 + 3 * d.hp * 4) +
         12 * 64;
}

template <class T>
T* take(char*& p, std::size_t bytes) {
  char* at = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(p) + 63) & ~std::uintptr_t(63));
  p = at + bytes;
  return reinterpret_cast<T*>(at);
}

RowScratch carve_row(void* scratch, const BackwardDims& d) {
  char* p = static_cast<char*>(scratch);
  RowScratch r;
  r.qrow = take<std::uint16_t>(p, d.hq * d.dp * 2);
  r.drow = take<std::uint16_t>(p, d.hq * d.dvq * 2);
  r.kb = take<std::uint16_t>(p, kBlock * d.dp * 2);
  r.kv = take<std::uint16_t>(p, paneled_elements(d.dp, kBlock / 2) * 2);
  r.s = take<float>(p, kBlock * d.hp * 4);
  r.dpb = take<float>(p, kBlock * d.hp * 4);
  r.dsa = take<std::uint16_t>(p, d.hp * kBlock * 2);
  r.dq = take<float>(p, d.hp * d.dp * 4);
  r.mx = take<float>(p, d.hp * 4);
  r.cf = take<float>(p, d.hp * 4);
  r.dl = take<float>(p, d.hp * 4);
  return r;
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

// p = exp(scale * s - max) * coef and ds = p * (dp - delta), 16 heads at a time.
inline void softmax_grad(__m512 s, __m512 dp, __m512 scale, __m512 mx, __m512 cf, __m512 dl, __mmask16 live,
                         __m512& p, __m512& ds) {
  p = _mm512_maskz_mov_ps(live, _mm512_mul_ps(exp512(_mm512_fmsub_ps(s, scale, mx)), cf));
  ds = _mm512_maskz_mul_ps(live, p, _mm512_sub_ps(dp, dl));  // 0, not 0 * NaN, for a head with max -inf
}

void pair_backward_query_row(const Shape& s, const QueryRow& query, const RowBackward& row, const KeyRows& keys,
                            void* scratch, void* d_query, void* d_query_rope) {
  const BackwardDims d(s);
  const RowScratch r = carve_row(scratch, d);
  const PackedRow pk(row.packed, d);
  configure_tiles();
  // Contiguous [heads][dims] copies of the row's query (+ rope) and grad_out.
  const auto* q = reinterpret_cast<const std::uint16_t*>(query.q);
  const auto* qr = reinterpret_cast<const std::uint16_t*>(query.q_rope);
  const auto* go = reinterpret_cast<const std::uint16_t*>(row.grad_out);
  // A head with max -inf (an empty row, or keys whose logits are all NaN) adds
  // to no gradient, as in the reference: its rows stay zero like the padding
  // heads', so that its zero weights meet no NaN in either pass.
  for (std::int64_t h = 0; h < d.hq; ++h) {
    std::uint16_t* qd = r.qrow + h * d.dp;
    std::uint16_t* gd = r.drow + h * d.dvq;
    if (h < s.heads && row.max[h] != core::kNegInf) {
      std::memcpy(qd, q + h * query.q_head_stride, s.dim * 2);
      if (s.rope_dim) std::memcpy(qd + s.dim, qr + h * query.q_rope_head_stride, s.rope_dim * 2);
      std::memset(qd + s.qk_dim(), 0, (d.dp - s.qk_dim()) * 2);
      std::memcpy(gd, go + h * row.go_head_stride, s.d_v * 2);
      std::memset(gd + s.d_v, 0, (d.dvq - s.d_v) * 2);
    } else {
      std::memset(qd, 0, d.dp * 2);
      std::memset(gd, 0, d.dvq * 2);
    }
  }
  pack_dim_pairs(r.qrow, d.dp, d, pk.qb1);
  pack_dim_pairs(r.drow, d.dvq, d, pk.db1);
  const std::int64_t head_panel = panel_stride(d.hq / 2);
  for (std::int64_t pr = 0; pr < d.hq / 2; ++pr) {
    interleave_rows(r.qrow + 2 * pr * d.dp, r.qrow + (2 * pr + 1) * d.dp, d.dp, d.dp, pk.qb2 + pr * 32, head_panel);
    interleave_rows(r.drow + 2 * pr * d.dvq, r.drow + (2 * pr + 1) * d.dvq, s.d_v, d.dvp, pk.db2 + pr * 32,
                    head_panel);
  }
  load_constants(s, d, row, r.mx, r.cf, r.dl);
  std::memset(r.dq, 0, d.hp * d.dp * 4);
  const __m512 scale = _mm512_set1_ps(s.scale);

  for (std::int64_t first = 0; first < keys.count; first += kBlock) {
    const std::int64_t n = std::min(kBlock, keys.count - first);
    gather_block(s, d, keys, first, n, r.kb, r.kv, d.dp, d.dp);
    const std::int64_t key_tiles = (n + 15) / 16;
    tile_gemm(false, r.s, d.hp, key_tiles, d.groups, r.kb, d.dp, pk.qb1, 32, d.groups * 512, 512, d.chunks);
    tile_gemm(false, r.dpb, d.hp, key_tiles, d.groups, r.kb, d.dp, pk.db1, 32, d.groups * 512, 512, d.dvq / 32);
    for (std::int64_t g = 0; g < d.groups; ++g) {
      const __m512 mx = _mm512_load_ps(r.mx + g * 16), cf = _mm512_load_ps(r.cf + g * 16),
                   dl = _mm512_load_ps(r.dl + g * 16);
      const __mmask16 live = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(core::kNegInf), _CMP_NEQ_OQ);
      for (std::int64_t k = 0; k < kBlock; ++k) {
        float* srow = r.s + k * d.hp + g * 16;
        __m512 p, ds = _mm512_setzero_ps();
        if (k < n)
          softmax_grad(_mm512_load_ps(srow), _mm512_load_ps(r.dpb + k * d.hp + g * 16), scale, mx, cf, dl, live, p, ds);
        _mm512_store_ps(srow, ds);
      }
      for (std::int64_t kt = 0; kt < kBlock / 16; ++kt)
        transpose16_to_bf16(r.s + kt * 16 * d.hp + g * 16, d.hp, r.dsa + g * 16 * kBlock + kt * 16, kBlock);
    }
    tile_gemm(true, r.dq, d.dp, d.groups, d.dp / 16, r.dsa, kBlock, r.kv, 32, 512, panel_stride(kBlock / 2),
              (n + 31) / 32);
  }
  auto* dq_out = static_cast<std::uint16_t*>(d_query);
  auto* dqr_out = static_cast<std::uint16_t*>(d_query_rope);
  for (std::int64_t h = 0; h < s.heads; ++h) {
    float* acc = r.dq + h * d.dp;
    if (r.mx[h] == core::kNegInf) std::fill(acc, acc + s.qk_dim(), 0.0f);  // dS 0 met NaN keys
    for (std::int64_t k = 0; k < s.dim; ++k) dq_out[h * s.dim + k] = core::float_to_bf16(acc[k] * s.scale);
    for (std::int64_t k = 0; k < s.rope_dim; ++k)
      dqr_out[h * s.rope_dim + k] = core::float_to_bf16(acc[s.dim + k] * s.scale);
  }
}

struct BlockScratch {
  std::uint16_t* kbb;  // [owned + 32][dp]: the owned keys, zero rows past the block
  std::uint16_t* ke;   // [32][dp]: gathered entries when they are not a contiguous run
  float* acc;          // [owned + 32][dp]
  float* tmp;          // [32][dp]
  float* s;            // [kSub][hp]
  float* dpb;          // [kSub][hp]
  std::uint16_t* pa;   // [kSub][hq]
  std::uint16_t* dsa;  // [kSub][hq]
  float *mx, *cf, *dl;
  __mmask16* live;     // [hp / 16]: heads with a finite max
  float* weights;      // [owned]: how often the token lists each key
  std::int64_t* per_sub;  // [owned / kSub]: the token's entries per sub-block
};

// Owned rows plus one 32-entry chunk of overrun: a contiguous run starting at
// any offset reads (and adds exact zeros to) rows past the block.
constexpr std::int64_t kOverrun = 32;
constexpr std::int64_t kSub = 64;  // keys per tile pass of the dkv kernel
static_assert(kMinOwnerBlock % kSub == 0 && kMaxOwnerBlock <= 65536, "offsets are uint16 and sub-blocks tile the block");

std::size_t block_scratch_bytes(const BackwardDims& d, std::int64_t owned) {
  const std::int64_t rows = owned + kOverrun;
  return static_cast<std::size_t>(rows * d.dp * 2 + 32 * d.dp * 2 + rows * d.dp * 4 + 32 * d.dp * 4 +
                                  2 * kSub * d.hp * 4 + 2 * kSub * d.hq * 2 + 3 * d.hp * 4 + d.hp + owned * 4 +
                                  owned / kSub * 8) +
         15 * 64;
}

BlockScratch carve_block(void* scratch, const BackwardDims& d, std::int64_t owned) {
  char* p = static_cast<char*>(scratch);
  const std::int64_t rows = owned + kOverrun;
  BlockScratch b;
  b.kbb = take<std::uint16_t>(p, rows * d.dp * 2);
  b.ke = take<std::uint16_t>(p, 32 * d.dp * 2);
  b.acc = take<float>(p, rows * d.dp * 4);
  b.tmp = take<float>(p, 32 * d.dp * 4);
  b.s = take<float>(p, kSub * d.hp * 4);
  b.dpb = take<float>(p, kSub * d.hp * 4);
  b.pa = take<std::uint16_t>(p, kSub * d.hq * 2);
  b.dsa = take<std::uint16_t>(p, kSub * d.hq * 2);
  b.mx = take<float>(p, d.hp * 4);
  b.cf = take<float>(p, d.hp * 4);
  b.dl = take<float>(p, d.hp * 4);
  b.live = take<__mmask16>(p, d.hp);
  b.weights = take<float>(p, owned * 4);
  b.per_sub = take<std::int64_t>(p, owned / kSub * 8);
  return b;
}

void pair_backward_key_block(const Shape& s, const KeyRows& block, const TokenEntries* tokens, std::int64_t n_tokens,
                            void* scratch, float* partial, void* d_main, void* d_rope) {
  const BackwardDims d(s);
  const std::int64_t head_panel = panel_stride(d.hq / 2);  // of the packed qb2 / db2
  const std::int64_t owned_rows = block.count + kOverrun;
  const BlockScratch b = carve_block(scratch, d, s.owner_rows);
  configure_tiles();
  for (std::int64_t k = 0; k < owned_rows; ++k) {
    std::uint16_t* row = b.kbb + k * d.dp;
    if (k < block.count) {
      std::memcpy(row, block.main[k], s.dim * 2);
      if (s.rope_dim) std::memcpy(row + s.dim, block.rope[k], s.rope_dim * 2);
      std::memset(row + s.qk_dim(), 0, (d.dp - s.qk_dim()) * 2);
    } else {
      std::memset(row, 0, d.dp * 2);
    }
  }
  start_block_sums(s, partial, block.count, owned_rows, d.dp, b.acc);
  std::memset(b.ke, 0, 32 * d.dp * 2);
  const __m512 scale = _mm512_set1_ps(s.scale);
  // P^T and dS^T rows (bf16, scaled by weight(e); rows >= valid are zero) for
  // the S^T / dP^T rows in b.s / b.dpb.
  auto epilogue = [&](std::int64_t rows, std::int64_t valid, auto&& weight) {
    for (std::int64_t e = 0; e < rows; ++e) {
      std::uint16_t* prow = b.pa + e * d.hq;
      std::uint16_t* drow = b.dsa + e * d.hq;
      const float w = e < valid ? weight(e) : 0.0f;
      const __m512 vw = _mm512_set1_ps(w), vws = _mm512_set1_ps(w * s.scale);
      for (std::int64_t g = 0; g < d.groups; ++g) {
        __m512 p = _mm512_setzero_ps(), ds = _mm512_setzero_ps();
        if (w != 0.0f)
          softmax_grad(_mm512_load_ps(b.s + e * d.hp + g * 16), _mm512_load_ps(b.dpb + e * d.hp + g * 16), scale,
                       _mm512_load_ps(b.mx + g * 16), _mm512_load_ps(b.cf + g * 16),
                       _mm512_load_ps(b.dl + g * 16), b.live[g], p, ds);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + g * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(p, vw)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(drow + g * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(ds, vws)));
      }
      for (std::int64_t h = d.hp; h < d.hq; ++h) prow[h] = drow[h] = 0;
    }
  };
  // The owned block is processed in sub-blocks of kSub keys, token by token,
  // so a token's packed operands are read once per owned block (not once per
  // sub-block) while the per-token tile work stays kSub keys wide. A sub-block
  // the token attends densely runs over all its keys; the entries of sparse
  // sub-blocks are pooled, 32 at a time across sub-blocks, so a token with a
  // few entries spread over a wide block still fills its tiles.
  const std::int64_t n_sub = (block.count + kSub - 1) / kSub;
  std::uint16_t chunk[32];
  for (std::int64_t t = 0; t < n_tokens; ++t) {
    const TokenEntries& tok = tokens[t];
    const PackedRow pk(tok.row.packed, d);
    load_constants(s, d, tok.row, b.mx, b.cf, b.dl);
    for (std::int64_t g = 0; g < d.groups; ++g)
      b.live[g] = _mm512_cmp_ps_mask(_mm512_load_ps(b.mx + g * 16), _mm512_set1_ps(core::kNegInf), _CMP_NEQ_OQ);
    std::fill(b.per_sub, b.per_sub + n_sub, 0);
    std::fill(b.weights, b.weights + block.count, 0.0f);
    for (std::int64_t e = 0; e < tok.count; ++e) {
      b.weights[tok.offsets[e]] += 1.0f;
      ++b.per_sub[tok.offsets[e] / kSub];
    }
    // The pooled sparse entries: dK rows += dS^T . Q (all dims), dV rows += P^T . dO (value dims).
    std::int64_t ne = 0;
    auto flush = [&] {
      if (ne == 0) return;
      const std::uint16_t* off = chunk;
      bool run = true;
      for (std::int64_t i = 1; i < ne && run; ++i) run = off[i] == off[0] + i;
      const std::uint16_t* a;
      if (run) {
        a = b.kbb + off[0] * d.dp;  // rows past the run are other keys or zeros: masked below
      } else {
        for (std::int64_t i = 0; i < ne; ++i) std::memcpy(b.ke + i * d.dp, b.kbb + off[i] * d.dp, d.dp * 2);
        a = b.ke;
      }
      const std::int64_t m_tiles = (ne + 15) / 16;
      tile_gemm(false, b.s, d.hp, m_tiles, d.groups, a, d.dp, pk.qb1, 32, d.groups * 512, 512, d.chunks);
      tile_gemm(false, b.dpb, d.hp, m_tiles, d.groups, a, d.dp, pk.db1, 32, d.groups * 512, 512, d.dvq / 32);
      epilogue(m_tiles * 16, ne, [](std::int64_t) { return 1.0f; });
      float* c = run ? b.acc + off[0] * d.dp : b.tmp;
      tile_gemm2(run, c, d.dp, m_tiles, d.dp / 16, b.dsa, d.hq, pk.qb2, 32, 512, head_panel, d.hq / 32, d.dvp / 16,
                 b.pa, pk.db2, 32, 512, d.hq / 32);
      if (!run)
        for (std::int64_t i = 0; i < ne; ++i) {
          float* dst = b.acc + off[i] * d.dp;
          const float* src = b.tmp + i * d.dp;
          for (std::int64_t k = 0; k < d.dp; k += 16)
            _mm512_store_ps(dst + k, _mm512_add_ps(_mm512_load_ps(dst + k), _mm512_load_ps(src + k)));
        }
      ne = 0;
    };
    for (std::int64_t sb = 0; sb < n_sub; ++sb) {
      const std::int64_t count = b.per_sub[sb];
      if (count == 0) continue;
      const std::int64_t base = sb * kSub, rows = std::min(kSub, block.count - base);
      if (100 * count >= kDenseSubBlockPercent * rows) {
        // Dense over the sub-block: every key once, weighted by how often the
        // token lists it (0 for keys it does not attend). No gathers, no scatter,
        // but the unlisted keys' products are wasted: worth it where products are
        // cheap against the gather (AMX tiles), not on vdpbf16ps, whose kernel
        // goes dense only for a full sub-block (kDenseSubBlockPercent).
        const std::int64_t m_tiles = (rows + 15) / 16;
        const std::uint16_t* a = b.kbb + base * d.dp;
        tile_gemm(false, b.s, d.hp, m_tiles, d.groups, a, d.dp, pk.qb1, 32, d.groups * 512, 512, d.chunks);
        tile_gemm(false, b.dpb, d.hp, m_tiles, d.groups, a, d.dp, pk.db1, 32, d.groups * 512, 512, d.dvq / 32);
        epilogue(m_tiles * 16, rows, [&](std::int64_t e) { return b.weights[base + e]; });
        tile_gemm2(true, b.acc + base * d.dp, d.dp, m_tiles, d.dp / 16, b.dsa, d.hq, pk.qb2, 32, 512, head_panel,
                   d.hq / 32, d.dvp / 16, b.pa, pk.db2, 32, 512, d.hq / 32);
        continue;
      }
      // Sparse: the token's entries in this sub-block, in list order, into the pool.
      for (std::int64_t scan = 0; scan < tok.count; ++scan)
        if (tok.offsets[scan] / kSub == sb) {
          chunk[ne++] = tok.offsets[scan];
          if (ne == 32) flush();
        }
    }
    flush();
  }
  if (keep_block_sums(s, b.acc, block.count, d.dp, partial)) return;
  auto* dm = static_cast<std::uint16_t*>(d_main);
  auto* dr = static_cast<std::uint16_t*>(d_rope);
  for (std::int64_t k = 0; k < block.count; ++k) {
    const float* acc = b.acc + k * d.dp;
    for (std::int64_t j = 0; j < s.dim; ++j) dm[k * s.dim + j] = core::float_to_bf16(acc[j]);
    for (std::int64_t j = 0; j < s.rope_dim; ++j) dr[k * s.rope_dim + j] = core::float_to_bf16(acc[s.dim + j]);
  }
}

std::size_t pair_scratch_bytes(const Shape& s) {
  const BackwardDims d(s);
  return std::max({forward_bytes(d), row_scratch_bytes(d), block_scratch_bytes(d, s.owner_rows),
                   avx512_kernel().scratch_bytes(s)});
}

}  // namespace

const AttentionKernel& DSA_PAIR_KERNEL_NAME() {
  static const AttentionKernel kernel{DSA_PAIR_KERNEL_LABEL,  pair_scratch_bytes,      pair_packed_row_bytes,
                                      pair_forward_row,       pair_backward_query_row, pair_backward_key_block,
                                      /*decodes_rows=*/true};
  return kernel;
}

}  // namespace dsa::cpu::attention_kernels
