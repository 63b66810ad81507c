// What the generic fused KL kernels (written for the compiler's vectorizer)
// share: vectorizable exp/log, the small fp32 GEMMs and transposes, row packing
// and the task runner. Included by kl_loss/kl_generic_sparse.h and
// dense_indexer/dense_kl_generic.h, which kl_{portable,avx2,avx512}.cpp and
// dense_kl_{portable,avx2,avx512}.cpp compile per ISA; not a self-contained
// header (DSA_KL_ROW_BLOCK comes from the including file).
//
// Shapes of work:
// - sparse (4.3): one task = a few query rows; each row's valid entries are
//   gathered 32 at a time into transposed fp32 tiles, the teacher logits of all
//   H heads and the indexer dots of all Hi heads are small GEMMs against them.
//   Backward: dQ/dW per row (tasks own rows); dK per key from an inverted index
//   (keys -> entries, built in row order), so every sum has a fixed order.
// - dense (4.4): one task = 16 queries of one sequence streaming 32-key tiles
//   (forward, dQ/dW); dK: one task = one 32-key tile streaming the query blocks
//   that see it. Nothing is O(T * S); scratch is per thread and bounded.
// Per-row partial losses are summed in row order: same bits for any thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/isa/rows.h"
#include "ops/kl_loss.h"
#if defined(__AVX2__)
#include "cpu/isa/fma.h"
#endif

namespace dsa::cpu::kl_kernels {
namespace {

using std::int64_t;

constexpr int64_t kTile = 32;        // keys (or gathered entries) per tile
constexpr int64_t kRowBlock = DSA_KL_ROW_BLOCK;
// dense: queries per block. Every query-major pass reads each visible key
// tile once per block, so the block's size divides that (memory) traffic.
constexpr int64_t kQueryBlock = 32;
constexpr int64_t kSparseRows = 4;   // sparse: query rows per task
constexpr int64_t kDenseKeyTiles = 2;  // dense dK: key tiles per task (each query block converted once for them)
constexpr int64_t kKeyTask = 128;    // sparse backward: keys per dK task (a row's selected ones are one GEMM)

// exp for x <= ~88 (Cephes-style; ~1 ulp), vectorizable; exact 0 below the fp32 range.
inline float fast_exp(float x) {
  const float c = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(c * 1.44269504088896341f + 0.5f);
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  // A NaN x makes n NaN, whose conversion to int is undefined (clang's UBSan stops
  // there); r, and so the result, is NaN already, so any exponent serves.
  const float n_finite = n == n ? n : 0.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n_finite) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : y * scale;
}

// Natural log for normal positive x (Cephes-style), vectorizable.
inline float fast_log(float x) {
  std::int32_t bits;
  std::memcpy(&bits, &x, 4);
  float e = static_cast<float>(((bits >> 23) & 0xff) - 126);
  bits = (bits & 0x007fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, 4);
  const bool small = m < 0.707106781186547524f;
  e = small ? e - 1.0f : e;
  m = small ? m + m - 1.0f : m - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return m + y + 0.693359375f * e;
}

// a * b + c as one rounding where the ISA has FMA: the scalar column tails of
// mm() then give the bits its vector body gives (fma::gemm's chains).
inline float mul_add(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

using core::relu;  // keeps NaN, as torch.relu and the lightning indexer do

// Partial sums of a tile reduction: kTile / kSumLanes terms each, then the
// lanes added in order. A fixed order the vectorizer can run as one vector.
constexpr int64_t kSumLanes = 8;
inline float sum_lanes(const float* lanes) {
  float s = 0.0f;
  for (int64_t l = 0; l < kSumLanes; ++l) s += lanes[l];
  return s;
}

#if defined(__AVX2__)
// fast_exp on a vector: the same clamp, reduction and polynomial (n rounded to
// nearest even), 0 below -87. The vectorizer leaves the scalar form's clamps
// and select as a branchy scalar loop, which the profile showed next to the GEMMs.
inline fma::Vec vfast_exp(fma::Vec x) {
  using namespace fma;
#if defined(__AVX512F__)
  const Vec c = _mm512_min_ps(vset(88.0f), vmax(vset(-87.0f), x));  // x second: NaN passes both
#else
  const Vec c = _mm256_min_ps(vset(88.0f), vmax(vset(-87.0f), x));
#endif
  const Vec n = vround(vmul(c, vset(1.44269504088896341f)));
  Vec r = vfma(n, vset(-0.693359375f), c);
  r = vfma(n, vset(2.12194440e-4f), r);
  Vec y = vset(1.9875691500e-4f);
  y = vfma(y, r, vset(1.3981999507e-3f));
  y = vfma(y, r, vset(8.3334519073e-3f));
  y = vfma(y, r, vset(4.1665795894e-2f));
  y = vfma(y, r, vset(1.6666665459e-1f));
  y = vfma(y, r, vset(5.0000001201e-1f));
  y = vadd(vfma(vmul(y, r), r, r), vset(1.0f));
  const Vec e = vpow2(y, n);
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset(-87.0f), _CMP_NLT_UQ), e);
#else
  return _mm256_and_ps(_mm256_cmp_ps(x, vset(-87.0f), _CMP_NLT_UQ), e);
#endif
}
#endif

#if defined(__AVX2__)
// x where d > 0, else 0 (a NaN d gives 0, as relu's comparison does).
inline fma::Vec vwhere_positive(fma::Vec d, fma::Vec x) {
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ), x);
#else
  return _mm256_and_ps(_mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ), x);
#endif
}
#endif

// c[i] = d[i] > 0 ? g * w[i] : 0 for i < n: the ReLU gate of a gradient coefficient.
inline void gate(const float* d, float g, const float* w, int64_t n, float* c) {
  int64_t i = 0;
#if defined(__AVX2__)
  using namespace fma;
  for (; i + kLanes <= n; i += kLanes) vstore(c + i, vwhere_positive(vload(d + i), vmul(vset(g), vload(w + i))));
#endif
  for (; i < n; ++i) c[i] = d[i] > 0.0f ? g * w[i] : 0.0f;
}

// One head's tile of dW terms and coefficients: returns sum_e g[e] * relu(d[e])
// (kSumLanes partial sums, added in order) and sets c[e] = d[e] > 0 ? g[e] * w : 0.
inline float gate_tile(const float* d, const float* g, float w, float* c) {
  float lanes[kSumLanes] = {};
#if defined(__AVX2__)
  // One ymm of partial sums on AVX2 and AVX-512 alike (kSumLanes == 8).
  static_assert(kSumLanes == 8 && kTile % 8 == 0, "one ymm of partial sums");
  __m256 acc = _mm256_setzero_ps();
  const __m256 wv = _mm256_set1_ps(w), zero = _mm256_setzero_ps();
  for (int64_t e = 0; e < kTile; e += 8) {
    const __m256 dv = _mm256_loadu_ps(d + e), gv = _mm256_loadu_ps(g + e);
    acc = _mm256_fmadd_ps(gv, _mm256_max_ps(zero, dv), acc);  // relu keeping NaN
    _mm256_storeu_ps(c + e, _mm256_and_ps(_mm256_cmp_ps(dv, zero, _CMP_GT_OQ), _mm256_mul_ps(gv, wv)));
  }
  _mm256_storeu_ps(lanes, acc);
#else
  for (int64_t e0 = 0; e0 < kTile; e0 += kSumLanes)
    for (int64_t l = 0; l < kSumLanes; ++l) {
      const float dv = d[e0 + l], gv = g[e0 + l];
      lanes[l] = mul_add(gv, relu(dv), lanes[l]);
      c[e0 + l] = dv > 0.0f ? gv * w : 0.0f;
    }
#endif
  return sum_lanes(lanes);
}

// acc[s][t] += exp(scale * l[s][t] + neg_max[t]) * inv[t] for s < n, t < kQueryBlock:
// add_exp_tile's operations on the transposed tile, element for element.
inline void add_exp_rows(const float* l, int64_t n, float scale, const float* neg_max, const float* inv, float* acc) {
#if defined(__AVX2__)
  using namespace fma;
  static_assert(kQueryBlock % kLanes == 0, "whole vectors of queries");
  for (int64_t s = 0; s < n; ++s)
    for (int64_t t = 0; t < kQueryBlock; t += kLanes) {
      const int64_t i = s * kQueryBlock + t;
      // A head with inv 0 (empty in the forward) adds nothing: not 0 * a NaN
      // logit, as the key-major form and the reference skip it.
      const Vec x = vfma(vset(scale), vload(l + i), vload(neg_max + t)), iv = vload(inv + t), a = vload(acc + i);
#if defined(__AVX512F__)
      vstore(acc + i, _mm512_mask3_fmadd_ps(vfast_exp(x), iv, a, _mm512_cmp_ps_mask(iv, vzero(), _CMP_NEQ_OQ)));
#else
      vstore(acc + i, _mm256_blendv_ps(a, vfma(vfast_exp(x), iv, a), _mm256_cmp_ps(iv, vzero(), _CMP_NEQ_OQ)));
#endif
    }
#else
  for (int64_t s = 0; s < n; ++s)
    for (int64_t t = 0; t < kQueryBlock; ++t)
      if (inv[t] != 0.0f) acc[s * kQueryBlock + t] += fast_exp(scale * l[s * kQueryBlock + t] + neg_max[t]) * inv[t];
#endif
}

// g[s] = s < count ? factor * (exp(score[s] - lse) - teacher[s]) : 0 for s < kTile.
inline void grad_tile(const float* score, float lse, const float* teacher, float factor, int64_t count, float* g) {
  int64_t s = 0;
#if defined(__AVX2__)
  using namespace fma;
  for (; s + kLanes <= std::min(count, kTile); s += kLanes)
    vstore(g + s, vmul(vset(factor), vsub(vfast_exp(vsub(vload(score + s), vset(lse))), vload(teacher + s))));
#endif
  for (; s < kTile; ++s) g[s] = s < count ? factor * (fast_exp(score[s] - lse) - teacher[s]) : 0.0f;
}

// acc[e] += exp(scale * l[e] - mx) * inv for e < kTile (a head's teacher share).
inline void add_exp_tile(const float* l, float scale, float mx, float inv, float* acc) {
#if defined(__AVX2__)
  using namespace fma;
  for (int64_t e = 0; e < kTile; e += kLanes) {
    const Vec x = vfma(vset(scale), vload(l + e), vset(-mx));
    vstore(acc + e, vfma(vfast_exp(x), vset(inv), vload(acc + e)));
  }
#else
  for (int64_t e = 0; e < kTile; ++e) acc[e] += fast_exp(scale * l[e] - mx) * inv;
#endif
}

void to_f32(const void* src, DType dtype, int64_t n, float* out) { rows::to_float(src, dtype, n, n, out); }

void from_f32(const float* src, DType dtype, int64_t n, void* out) { rows::from_float(src, dtype, n, out); }

// C rows (+)= A . B: crow[m][n] for m < M, n < N, with A(m, k) = arow[m][k * a_step]
// and B row k at b + k * b_stride. Every C element is one chain over k in order
// (acc = a * b + acc, from 0 or from C), whatever the blocking, so the same
// dot product computed in two passes (or two orientations) has the same bits.
// crow rows must be distinct (each block loads and stores its rows once).
void mm(int64_t M, int64_t N, int64_t K, const float* const* arow, int64_t a_step, const float* b,
        int64_t b_stride, float* const* crow, bool accumulate) {
  if (M <= 0 || N <= 0) return;
#if defined(__AVX2__)
  // The register-blocked GEMM on the columns that fill whole vectors.
  const int64_t n0 = N / fma::kLanes * fma::kLanes;
  if (n0 > 0) {
    // fma::gemm cuts M into blocks of kMr rows; a last block of 1-2 rows has too
    // few independent FMA chains to cover the FMA latency (the dense passes'
    // 32-row products ended in 2-row blocks, ~3% of the samples). Split the
    // last kMr + M % kMr rows into two blocks of about equal size instead.
    const int64_t tail = M % fma::kMr;
    const int64_t m_main = M > fma::kMr && tail > 0 && tail <= 2 ? M - tail - fma::kMr : M;
    fma::gemm(m_main, n0, K, arow, a_step, b, b_stride, crow, accumulate);
    const int64_t rest = M - m_main, half = (rest + 1) / 2;
    if (rest > 0) {
      fma::gemm(half, n0, K, arow + m_main, a_step, b, b_stride, crow + m_main, accumulate);
      fma::gemm(rest - half, n0, K, arow + m_main + half, a_step, b, b_stride, crow + m_main + half, accumulate);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < N; ++n) {
      float acc = accumulate ? crow[m][n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = mul_add(arow[m][k * a_step], b[k * b_stride + n], acc);
      crow[m][n] = acc;
    }
#else
  // Portable: row by row, k outer and n inner so the vectorizer runs along n.
  for (int64_t m = 0; m < M; ++m) {
    float* c = crow[m];
    if (!accumulate) std::fill(c, c + N, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float a = arow[m][k * a_step];
      const float* bk = b + k * b_stride;
      for (int64_t n = 0; n < N; ++n) c[n] = mul_add(a, bk[n], c[n]);
    }
  }
#endif
}

// out[r][s] = sum_d a[r][d] * bt[d][s] for r < rows, s < kTile.
#if defined(__AVX2__)
void dots(const float* a, int64_t rows, int64_t dim, const float* bt, float* out) {
  constexpr int64_t kChunk = 64;  // row pointers handed to mm() at a time
  const float* arow[kChunk];
  float* crow[kChunk];
  for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
    const int64_t m = std::min(kChunk, rows - r0);
    for (int64_t r = 0; r < m; ++r) {
      arow[r] = a + (r0 + r) * dim;
      crow[r] = out + (r0 + r) * kTile;
    }
    mm(m, kTile, dim, arow, 1, bt, kTile, crow, false);
  }
}
#else
// Portable: kRowBlock rows at a time against the tile (the same chains as mm()).
void dots(const float* a, int64_t rows, int64_t dim, const float* bt, float* out) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) {
    float acc[kRowBlock][kTile] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float* b = bt + d * kTile;
      for (int64_t k = 0; k < kRowBlock; ++k) {
        const float av = a[(r + k) * dim + d];
        for (int64_t s = 0; s < kTile; ++s) acc[k][s] = mul_add(av, b[s], acc[k][s]);
      }
    }
    std::memcpy(out + r * kTile, acc, sizeof(acc));
  }
  for (; r < rows; ++r) {
    float acc[kTile] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float av = a[r * dim + d];
      const float* b = bt + d * kTile;
      for (int64_t s = 0; s < kTile; ++s) acc[s] = mul_add(av, b[s], acc[s]);
    }
    std::memcpy(out + r * kTile, acc, sizeof(acc));
  }
}
#endif

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols: in
// register transposes where the ISA has them, scalar for the edges.
void transpose(const float* src, int64_t src_stride, int64_t rows, int64_t cols, float* dst, int64_t dst_stride) {
  int64_t r0 = 0;
#if defined(__AVX2__)
  r0 = rows / fma::kLanes * fma::kLanes;
  const int64_t c0 = cols / fma::kLanes * fma::kLanes;
  if (r0 > 0 && c0 > 0) fma::transpose(src, src_stride, r0, c0, dst, dst_stride);
  for (int64_t r = 0; r < r0; ++r)
    for (int64_t c = c0; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
#endif
  for (int64_t r = r0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
}

// Asks for the cache lines of [p, p + bytes).
inline void prefetch(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// Heads [h0, h0 + count) of one row, main dims then rope dims: out[h][D + Dr].
void pack_heads(const HeadMatrix& m, const HeadMatrix& rope, int64_t row, int64_t h0, int64_t count, float* out) {
  const int64_t width = m.dim + (rope.present() ? rope.dim : 0);
  for (int64_t h = 0; h < count; ++h) {
    to_f32(m.bytes(row, h0 + h), m.dtype, m.dim, out + h * width);
    if (rope.present()) to_f32(rope.bytes(row, h0 + h), rope.dtype, rope.dim, out + h * width + m.dim);
  }
}

// Key tile of head `head` of the given key rows: `rows` gets them as fp32
// [kTile][D + Dr] (main then rope dims), rows past n 0, and bt their
// transpose [D + Dr][kTile]. Converting whole rows and transposing in
// registers keeps the packing small next to the products that use it.
void pack_key_tile(const HeadMatrix& k, const HeadMatrix& rope, const int64_t* key_rows, int64_t n,
                   int64_t head, float* bt, float* rows) {
  const int64_t width = k.dim + (rope.present() ? rope.dim : 0);
  for (int64_t s = 0; s < n; ++s) {
    to_f32(k.bytes(key_rows[s], head), k.dtype, k.dim, rows + s * width);
    if (rope.present()) to_f32(rope.bytes(key_rows[s], head), rope.dtype, rope.dim, rows + s * width + k.dim);
  }
  if (n < kTile) std::memset(rows + n * width, 0, sizeof(float) * (kTile - n) * width);
  transpose(rows, width, kTile, width, bt, kTile);
}

// 1 / (sum + exp(sink - max)) of a head's forward statistics; 0 for heads
// whose row was empty in the forward (they contribute nothing). A NaN max or
// sum is no empty row: its NaN reaches the teacher.
inline float inverse_denominator(float max, float sum, const float* sink) {
  if (max == core::kNegInf || sum <= 0.0f) return 0.0f;
  return 1.0f / (sum + (sink ? std::exp(*sink - max) : 0.0f));
}

template <class Body>
void run_tasks(int64_t n_tasks, int num_threads, const Body& body) {
  const int threads = std::max(1, std::min<int>(num_threads, static_cast<int>(std::min<int64_t>(n_tasks, 1 << 20))));
  core::parallel_for(n_tasks, threads, [&](int64_t task, int thread) { body(task, thread); });
}

int thread_count(int64_t n_tasks, int num_threads) {
  return std::max(1, static_cast<int>(std::min<int64_t>(n_tasks, num_threads)));
}

// Sizes a float scratch buffer, never empty: D = 0 or Di = 0 is legal, and an
// empty vector's data() is null, which memset/memcpy must not get even for 0
// bytes (UBSan; found by fuzz_kl_loss and fuzz_dense_indexer).
void size_scratch(std::vector<float>& v, int64_t n) { v.resize(std::max<int64_t>(n, 1)); }

}  // namespace
}  // namespace dsa::cpu::kl_kernels
