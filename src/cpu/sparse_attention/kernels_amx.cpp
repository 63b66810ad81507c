// AMX-BF16 attention kernels (bf16 inputs): the forward row kernel runs both
// GEMMs on tiles; the backward passes use the avx512 fp32 kernels.
//
// Forward, per query row (all heads of one token), per block of kBlock keys:
//   1. gather the keys' rows into a contiguous bf16 block Kb [kBlock][Dp]
//      (Dp = qk dims padded to 32) and interleave their value dims into the
//      VNNI pair layout Vv [kBlock/2][dv][2] that B tiles of P.V want;
//   2. S^T [keys][heads] = Kb . Q^T: A tiles straight from Kb (rows = keys),
//      B tiles from the query packed once per row in VNNI pairs of dims.
//      Computing S^T rather than S keeps the gathered keys as A (no transpose
//      of the wide key rows); only the small [keys][heads] block is transposed;
//   3. online softmax in fp32, vectorised over heads, with a lazily updated
//      reference max (rescale only when the max grows by more than kLazy, so
//      the [heads][d_v] accumulator is rarely touched); P is transposed to
//      bf16 [heads][keys] = the A tiles of
//   4. O [heads][d_v] += P . V on tiles, accumulated in an fp32 buffer.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "cpu/sparse_attention/attention_kernels.h"

namespace dsa::cpu::attention_kernels {
namespace {

constexpr std::int64_t kBlock = 64;  // keys per block: two 32-key chunks of P.V per C tile load
constexpr float kLazy = 8.0f;        // exp(8) ~ 3e3: P stays far from bf16 / fp32 limits

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

struct Dims {
  std::int64_t hp, dp, dvp, groups, chunks, dv_groups;
  explicit Dims(const Shape& s)
      : hp(round_up(s.heads, 16)), dp(round_up(s.qk_dim(), 32)), dvp(round_up(s.d_v, 16)),
        groups(hp / 16), chunks(dp / 32), dv_groups(dvp / 16) {}
};

struct Buffers {
  std::uint16_t* qb;  // [chunks][groups][16 pairs][16 heads][2]
  std::uint16_t* kb;  // [kBlock][dp]
  std::uint16_t* vv;  // [kBlock / 2][dvp][2]
  std::uint16_t* pa;  // [hp][kBlock]
  float* s;           // [kBlock][hp]
  float* o;           // [hp][dvp]
  float* max;         // [hp] reference max the block sums are relative to
  float* true_max;    // [hp]
  float* sum;         // [hp]
};

std::size_t forward_bytes(const Dims& d) {
  return static_cast<std::size_t>(d.dp * d.hp * 2 + kBlock * d.dp * 2 + kBlock * d.dvp * 2 + d.hp * kBlock * 2 +
                                  kBlock * d.hp * 4 + d.hp * d.dvp * 4 + 3 * d.hp * 4) +
         10 * 64;
}

Buffers carve(void* scratch, const Dims& d) {
  auto next = [p = static_cast<char*>(scratch)](std::size_t bytes) mutable {
    char* at = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(p) + 63) & ~std::uintptr_t(63));
    p = at + bytes;
    return at;
  };
  Buffers b;
  b.qb = reinterpret_cast<std::uint16_t*>(next(d.dp * d.hp * 2));
  b.kb = reinterpret_cast<std::uint16_t*>(next(kBlock * d.dp * 2));
  b.vv = reinterpret_cast<std::uint16_t*>(next(kBlock * d.dvp * 2));
  b.pa = reinterpret_cast<std::uint16_t*>(next(d.hp * kBlock * 2));
  b.s = reinterpret_cast<float*>(next(kBlock * d.hp * 4));
  b.o = reinterpret_cast<float*>(next(d.hp * d.dvp * 4));
  b.max = reinterpret_cast<float*>(next(d.hp * 4));
  b.true_max = reinterpret_cast<float*>(next(d.hp * 4));
  b.sum = reinterpret_cast<float*>(next(d.hp * 4));
  return b;
}

std::size_t amx_scratch_bytes(const Shape& s) {
  return std::max(forward_bytes(Dims(s)), avx512_kernel().scratch_bytes(s));
}

// exp for the softmax; inputs are <= kLazy above the reference max.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// dst[c][r] = src[r][c] for a 16 x 16 fp32 block, written as bf16.
inline void transpose16_to_bf16(const float* src, std::int64_t src_stride, std::uint16_t* dst,
                                std::int64_t dst_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4q + j] holds, per 128-bit lane k, column 4k + j of rows 4q .. 4q + 3.
  for (int j = 0; j < 4; ++j) {
    const __m512 a0 = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88), a1 = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xdd);
    const __m512 b0 = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0x88), b1 = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0xdd);
    const __m512 cols[4] = {_mm512_shuffle_f32x4(a0, b0, 0x88), _mm512_shuffle_f32x4(a1, b1, 0x88),
                            _mm512_shuffle_f32x4(a0, b0, 0xdd), _mm512_shuffle_f32x4(a1, b1, 0xdd)};
    for (int q = 0; q < 4; ++q)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (j + 4 * q) * dst_stride),
                          (__m256i)_mm512_cvtneps_pbh(cols[q]));
  }
}

// Query row -> B tiles of S^T = K . Q^T: pairs of dims (rows) by 16 heads (cols).
void pack_query(const Shape& s, const Dims& d, const QueryRow& q, std::uint16_t* qb) {
  std::memset(qb, 0, d.dp * d.hp * 2);
  const auto* base = reinterpret_cast<const std::uint16_t*>(q.q);
  const auto* rope = reinterpret_cast<const std::uint16_t*>(q.q_rope);
  for (std::int64_t h = 0; h < s.heads; ++h) {
    const std::int64_t g = h / 16, col = h % 16;
    for (std::int64_t k = 0; k < s.qk_dim(); ++k) {
      const std::uint16_t v = k < s.dim ? base[h * q.q_head_stride + k] : rope[h * q.q_rope_head_stride + k - s.dim];
      const std::int64_t c = k / 32, r = (k % 32) / 2;
      qb[(((c * d.groups + g) * 16 + r) * 16 + col) * 2 + (k & 1)] = v;
    }
  }
}

// Gathers up to kBlock keys into Kb and their values into the VNNI layout Vv.
void gather_block(const Shape& s, const Dims& d, const KeyRows& keys, std::int64_t first, std::int64_t n,
                  std::uint16_t* kb, std::uint16_t* vv) {
  for (std::int64_t k = 0; k < kBlock; ++k) {
    std::uint16_t* row = kb + k * d.dp;
    if (k < n) {
      std::memcpy(row, keys.main[first + k], s.dim * 2);
      if (s.rope_dim) std::memcpy(row + s.dim, keys.rope[first + k], s.rope_dim * 2);
      std::memset(row + s.qk_dim(), 0, (d.dp - s.qk_dim()) * 2);
    } else {
      std::memset(row, 0, d.dp * 2);
    }
  }
  // Vv[pair][col][2] = (Kb[2 pair][col], Kb[2 pair + 1][col]).
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                          22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  const std::int64_t pairs = (n + 1) / 2;
  for (std::int64_t pr = 0; pr < kBlock / 2; ++pr) {
    std::uint16_t* out = vv + pr * d.dvp * 2;
    if (pr >= pairs) {
      std::memset(out, 0, d.dvp * 4);
      continue;
    }
    const std::uint16_t* a = kb + 2 * pr * d.dp;
    const std::uint16_t* b = a + d.dp;
    std::int64_t c = 0;
    for (; c + 32 <= s.d_v; c += 32) {
      const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
      _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi16(va, lo_idx, vb));
      _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi16(va, hi_idx, vb));
    }
    for (; c < d.dvp; ++c) {
      out[2 * c] = c < s.d_v ? a[c] : 0;
      out[2 * c + 1] = c < s.d_v ? b[c] : 0;
    }
  }
}

void amx_forward_row(const Shape& s, const float* sinks, const QueryRow& query, const KeyRows& keys,
                     void* scratch, void* out, float* max_out, float* sum_out) {
  const Dims d(s);
  const Buffers b = carve(scratch, d);
  configure_tiles();
  pack_query(s, d, query, b.qb);
  std::memset(b.o, 0, d.hp * d.dvp * 4);
  for (std::int64_t h = 0; h < d.hp; ++h) {
    b.max[h] = b.true_max[h] = core::kNegInf;
    b.sum[h] = 0.0f;
  }
  const int kb_stride = static_cast<int>(d.dp * 2), s_stride = static_cast<int>(d.hp * 4);
  const int pa_stride = static_cast<int>(kBlock * 2), vv_stride = static_cast<int>(d.dvp * 4),
            o_stride = static_cast<int>(d.dvp * 4);
  const __m512 scale = _mm512_set1_ps(s.scale);

  for (std::int64_t first = 0; first < keys.count; first += kBlock) {
    const std::int64_t n = std::min(kBlock, keys.count - first);
    gather_block(s, d, keys, first, n, b.kb, b.vv);
    const std::int64_t key_tiles = (n + 15) / 16;

    // S^T = Kb . Q^T, 2 key tiles x 2 head groups of C at a time.
    for (std::int64_t kt = 0; kt < key_tiles; kt += 2) {
      const bool two_k = kt + 1 < key_tiles;
      for (std::int64_t g = 0; g < d.groups; g += 2) {
        const bool two_g = g + 1 < d.groups;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (std::int64_t c = 0; c < d.chunks; ++c) {
          _tile_loadd(4, b.kb + kt * 16 * d.dp + c * 32, kb_stride);
          _tile_loadd(6, b.qb + (c * d.groups + g) * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two_g) {
            _tile_loadd(7, b.qb + (c * d.groups + g + 1) * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_k) {
            _tile_loadd(5, b.kb + (kt + 1) * 16 * d.dp + c * 32, kb_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two_g) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, b.s + kt * 16 * d.hp + g * 16, s_stride);
        if (two_g) _tile_stored(1, b.s + kt * 16 * d.hp + (g + 1) * 16, s_stride);
        if (two_k) {
          _tile_stored(2, b.s + (kt + 1) * 16 * d.hp + g * 16, s_stride);
          if (two_g) _tile_stored(3, b.s + (kt + 1) * 16 * d.hp + (g + 1) * 16, s_stride);
        }
      }
    }

    // Online softmax, 16 heads per vector.
    for (std::int64_t g = 0; g < d.groups; ++g) {
      __m512 block_max = _mm512_set1_ps(core::kNegInf);
      for (std::int64_t k = 0; k < n; ++k) {
        float* row = b.s + k * d.hp + g * 16;
        const __m512 v = _mm512_mul_ps(_mm512_load_ps(row), scale);
        _mm512_store_ps(row, v);
        block_max = _mm512_max_ps(block_max, v);
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
      for (std::int64_t kt = 0; kt < kBlock / 16; ++kt)
        transpose16_to_bf16(b.s + kt * 16 * d.hp + g * 16, d.hp, b.pa + g * 16 * kBlock + kt * 16, kBlock);
    }

    // O += P . V, 2 head groups x 2 value column groups of C at a time.
    const std::int64_t key_chunks = (n + 31) / 32;
    for (std::int64_t g = 0; g < d.groups; g += 2) {
      const bool two_g = g + 1 < d.groups;
      for (std::int64_t j = 0; j < d.dv_groups; j += 2) {
        const bool two_j = j + 1 < d.dv_groups;
        float* o00 = b.o + g * 16 * d.dvp + j * 16;
        _tile_loadd(0, o00, o_stride);
        if (two_j) _tile_loadd(1, o00 + 16, o_stride);
        if (two_g) {
          _tile_loadd(2, o00 + 16 * d.dvp, o_stride);
          if (two_j) _tile_loadd(3, o00 + 16 * d.dvp + 16, o_stride);
        }
        for (std::int64_t kc = 0; kc < key_chunks; ++kc) {
          _tile_loadd(4, b.pa + g * 16 * kBlock + kc * 32, pa_stride);
          _tile_loadd(6, b.vv + kc * 16 * d.dvp * 2 + j * 32, vv_stride);
          _tile_dpbf16ps(0, 4, 6);
          if (two_j) {
            _tile_loadd(7, b.vv + kc * 16 * d.dvp * 2 + (j + 1) * 32, vv_stride);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_g) {
            _tile_loadd(5, b.pa + (g + 1) * 16 * kBlock + kc * 32, pa_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two_j) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, o00, o_stride);
        if (two_j) _tile_stored(1, o00 + 16, o_stride);
        if (two_g) {
          _tile_stored(2, o00 + 16 * d.dvp, o_stride);
          if (two_j) _tile_stored(3, o00 + 16 * d.dvp + 16, o_stride);
        }
      }
    }
  }

  auto* dst = static_cast<std::uint16_t*>(out);
  for (std::int64_t h = 0; h < s.heads; ++h) {
    const float m = b.true_max[h];
    float* orow = b.o + h * d.dvp;
    float f = 0.0f;
    if (m != core::kNegInf) {
      // Sums are relative to the reference max; the statistics to the true one.
      const float to_true = std::exp(b.max[h] - m);
      const float sum = b.sum[h] * to_true;
      float scale_m = 1.0f, sink_term = 0.0f;
      if (sinks && sinks[h] != core::kNegInf) {
        const float top = std::max(m, sinks[h]);
        scale_m = std::exp(m - top);
        sink_term = std::exp(sinks[h] - top);
      }
      f = to_true * scale_m / (sum * scale_m + sink_term);
      max_out[h] = m;
      sum_out[h] = sum;
    } else {
      max_out[h] = core::kNegInf;
      sum_out[h] = 0.0f;
    }
    std::int64_t c = 0;
    const __m512 vf = _mm512_set1_ps(f);
    for (; c + 16 <= s.d_v; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + h * s.d_v + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(orow + c), vf)));
    for (; c < s.d_v; ++c) dst[h * s.d_v + c] = core::float_to_bf16(orow[c] * f);
  }
}

}  // namespace

const AttentionKernel& amx_kernel() {
  static const AttentionKernel kernel{"amx", amx_scratch_bytes, amx_forward_row,
                                      avx512_kernel().backward_query_row, avx512_kernel().backward_key_block};
  return kernel;
}

}  // namespace dsa::cpu::attention_kernels
