// Kernels of the dense indexer KL loss (docs/ops.md 4.4) on bf16 pairs, bf16
// inputs, shared by dense_kl_amx.cpp (products on AMX tiles) and
// dense_kl_avx512bf16.cpp (the same products on vdpbf16ps). The engine includes
// this file and then defines, in dsa::cpu::kl_kernels' anonymous namespace, the
// hooks declared below ("Products"); DSA_KL_DENSE_KERNELS names its kernel table.
//
// Work unit: a block of 32 queries of one sequence against a tile of 32 keys.
// Every product is a [32 keys x K] x [K x 32 tokens] GEMM with the keys as the
// A operand, loaded straight from the key tensors (key[s, h, :] rows are
// equally strided), and the query block as the B operand, packed once per
// block to the VNNI pair layout (a 16x16 transpose of 32-bit dim pairs per
// head, chunk and 16 tokens). C tiles hold 16 keys x 16 tokens, so the
// per-(token, head) statistics (max, 1/denominator, indexer weight, lse,
// visibility) are lane vectors over tokens and nothing is transposed per key:
//   teacher  pT[s][t] = sum_h exp(scale * k_h[s] . q_h[t] - max_h[t]) * inv_h[t]
//   student  sT[s][t] = sum_j w_j[t] relu(ik[s] . iq_j[t])
// (heads summed in a fixed order). Backward, with
// g = factor * (exp(s - lse) - p / H) and coef_j = g * w_j * [dot_j > 0]:
//   dW_j[t]   = index_scale * sum_s g relu(dot_j)        (lanes over tokens)
//   dQ_j^T    = ik^T [Di x 32 keys] x coef_j [32 keys x 32 tokens]  (tasks own query blocks)
//   dK        = sum_j coef_j [32 keys x 32 tokens] x iq_j [32 tokens x Di]  (tasks own key tiles)
// The teacher is rebuilt in the forward, the dQ/dW pass and the dK pass (nothing
// O(T * S) is stored). Every sum has one owner and a fixed order: bit-identical
// for any thread count. Scratch is per thread and independent of S.
#include "cpu/isa/kl_pairs_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/dense_indexer/dense_kl_kernels.h"

namespace dsa::cpu::kl_kernels {
namespace {

using std::int64_t;
using namespace pairs;

constexpr int64_t kTq = 32;         // queries per block: two 16-token B tiles
constexpr int64_t kTk = 32;         // keys per tile: two 16-key A tiles
constexpr int64_t kChunk = kPairChunk;          // bf16 elements per 64-byte tile row
constexpr int64_t kMaxChunks = kPairMaxChunks;  // teacher dims up to 2048
constexpr int64_t kDqTiles = 4;     // dQ pass: key tiles per update of the fp32 dQ^T accumulator
constexpr int64_t kDkTiles = 2;     // dK task: key tiles sharing one packing of each query block's iq

// B operand of one head of a query block: tile (chunk c, token group tg) row r
// holds the dim pair (32c + 2r, 32c + 2r + 1) of tokens 16tg .. 16tg + 15.
// Tokens past `tokens` are zero. out: [chunks][2][256] u32.
void pack_tokens_vnni(const std::uint16_t* tok0, int64_t token_stride, int64_t tokens, int64_t chunks,
                      std::uint32_t* out) {
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t tg = 0; tg < 2; ++tg) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t t = tg * 16 + i;
        r[i] = t < tokens ? _mm512_loadu_si512(tok0 + t * token_stride + c * kChunk) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      std::uint32_t* tile = out + (c * 2 + tg) * 256;
      for (int row = 0; row < 16; ++row) _mm512_store_si512(tile + row * 16, r[row]);
    }
}

// Interleaves two 16-lane fp32 rows into one VNNI row of bf16 pairs (lo, hi).
inline __m512i pair_rows_bf16(__m512 lo, __m512 hi) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Where the A tiles (16 keys x 32 dims) of each chunk live.
struct ATiles {
  const std::uint16_t* ptr[kMaxChunks];
  int64_t stride[kMaxChunks];  // elements
  int64_t chunks = 0;
};

// Products (the engine's hooks; every operand in the AMX tile layouts):
//   configure_tiles() / release_tiles()   per-thread set-up and tear-down of a task
//   tile_gemm_32x32(a, b, c): c[32 keys][32 tokens] (row stride 32 floats) =
//     sum over a's chunks of A x B, B the packed tokens [chunks][2][256] u32;
//   dq_flush(dqt, ikt, cvnni, iheads, idim, count): for every head j,
//     dQ_j^T [Di][32 tokens] fp32 (at dqt + j * Di * 32) += ik^T [Di][count * 32
//     keys] (ikt, row stride kDqTiles * 32) . coef_j (cvnni + j * kDqTiles * 512,
//     [count][2][256] u32);
//   dk_update(dk, idim, coef, ivnni, iheads): dk [32 keys][Di] fp32 (row stride
//     Di) += sum over heads j of coef_j [32 keys][32 tokens] bf16 (coef + j *
//     1024) . iq_j token pairs (ivnni + j * (Di / 16) * 256, [Di / 16][256] u32).
void configure_tiles();
void release_tiles();
void tile_gemm_32x32(const ATiles& a, const std::uint32_t* b, float* c);
void dq_flush(float* dqt, const std::uint16_t* ikt, const std::uint32_t* cvnni, int64_t iheads, int64_t idim,
              int64_t count);
void dk_update(float* dk, int64_t idim, const std::uint16_t* coef, const std::uint32_t* ivnni, int64_t iheads);

bool counted_row(const DenseKlProblem& p, const core::SequenceSlice& seq, int64_t i) {
  return seq.position(i) >= 0 && !std::isinf(p.lse[seq.q_begin + i]);  // +inf: empty row; NaN is counted
}

int64_t counted_rows(const DenseKlProblem& p) {
  int64_t n = 0;
  for (const auto& seq : p.plan.seqs)
    for (int64_t i = 0; i < seq.q_len; ++i) n += counted_row(p, seq, i);
  return n;
}

using QueryTask = core::QueryBlock;

std::vector<QueryTask> query_tasks(const core::SequencePlan& plan) {
  return core::query_blocks(plan, kTq, [](const core::SequenceSlice& seq, int64_t first, int64_t tokens) {
    return seq.position(first + tokens - 1) + 2;
  });
}

int thread_count(int64_t n_tasks, int num_threads) {
  return std::max(1, static_cast<int>(std::min<int64_t>(std::max<int64_t>(n_tasks, 1), num_threads)));
}

// Per-thread state of one query block streaming key tiles.
struct Block {
  const DenseKlProblem& p;
  int64_t heads, key_heads, group, dmain, drope, dq, qchunks, iheads, idim, ichunks;
  core::ScratchVector<std::uint8_t> qpack_, ipack_, kbuf_, ikbuf_, dots_, cbuf_;
  std::uint32_t *qpack, *ipack;      // [H][qchunks][512], [Hi][ichunks][512]
  std::uint16_t *kbuf, *ikbuf;       // gathered partial key tiles: [32][dq], [32][Di]
  float *dots, *cbuf;                // [Hi][32][32] (backward), [32][32]
  std::vector<float> max, inv, w;    // [H][32], [H][32], [Hi][32] (w times index_scale)
  alignas(64) float pT[kTk][kTq], score[kTk][kTq], g[kTk][kTq];
  alignas(64) float lse[kTq];
  alignas(64) std::int32_t limit[kTq];  // keys [0, limit) count for the token (0: none)
  int64_t tokens = 0, row0 = 0, last = 0;
  bool any_live[1024];  // per head: some token has live statistics

  Block(const DenseKlProblem& problem, bool with_dots) : p(problem) {
    heads = p.query.heads;
    key_heads = p.key.heads;
    group = heads / key_heads;
    dmain = p.query.dim;
    drope = p.query_rope.present() ? p.query_rope.dim : 0;
    dq = dmain + drope;
    qchunks = dq / kChunk;
    iheads = p.index_query.heads;
    idim = p.index_query.dim;
    ichunks = idim / kChunk;
    qpack_.resize(heads * qchunks * 2048 + 64);
    ipack_.resize(iheads * ichunks * 2048 + 64);
    kbuf_.resize(kTk * dq * 2 + 64);
    ikbuf_.resize(kTk * idim * 2 + 64);
    dots_.resize((with_dots ? iheads * kTk * kTq * 4 : 0) + 64);
    cbuf_.resize(kTk * kTq * 4 + 64);
    qpack = align64<std::uint32_t>(qpack_);
    ipack = align64<std::uint32_t>(ipack_);
    kbuf = align64<std::uint16_t>(kbuf_);
    ikbuf = align64<std::uint16_t>(ikbuf_);
    dots = with_dots ? align64<float>(dots_) : nullptr;
    cbuf = align64<float>(cbuf_);
    max.resize(heads * kTq);
    inv.resize(heads * kTq);
    w.resize(iheads * kTq);
  }

  void load_queries(const core::SequenceSlice& seq, int64_t first, int64_t count) {
    tokens = count;
    row0 = seq.q_begin + first;
    last = 0;
    for (int64_t t = 0; t < kTq; ++t) {
      const bool real = t < tokens;
      const int64_t visible = real ? seq.position(first + t) + 1 : 0;
      last = std::max(last, visible);
      limit[t] = real && counted_row(p, seq, first + t) ? static_cast<std::int32_t>(visible) : 0;
      lse[t] = limit[t] > 0 ? p.lse[row0 + t] : 0.0f;
    }
    for (int64_t h = 0; h < heads; ++h) {
      pack_tokens_vnni(reinterpret_cast<const std::uint16_t*>(p.query.bytes(row0, h)), p.query.row_stride, tokens,
                       dmain / kChunk, qpack + h * qchunks * 512);
      if (drope)
        pack_tokens_vnni(reinterpret_cast<const std::uint16_t*>(p.query_rope.bytes(row0, h)),
                         p.query_rope.row_stride, tokens, drope / kChunk, qpack + (h * qchunks + dmain / kChunk) * 512);
      any_live[h] = false;
      for (int64_t t = 0; t < kTq; ++t) {
        const float mx = t < tokens ? p.softmax_max[(row0 + t) * heads + h] : core::kNegInf;
        const float sum = t < tokens ? p.softmax_sum[(row0 + t) * heads + h] : 0.0f;
        // Heads whose row was empty in the forward contribute nothing.
        const bool live = limit[t] > 0 && mx != core::kNegInf && !(sum <= 0.0f);  // NaN statistics reach the teacher
        max[h * kTq + t] = live ? mx : 0.0f;
        inv[h * kTq + t] = live ? 1.0f / sum : 0.0f;
        any_live[h] = any_live[h] || live;
      }
    }
    for (int64_t j = 0; j < iheads; ++j) {
      pack_tokens_vnni(reinterpret_cast<const std::uint16_t*>(p.index_query.bytes(row0, j)), p.index_query.row_stride,
                       tokens, ichunks, ipack + j * ichunks * 512);
      for (int64_t t = 0; t < kTq; ++t)
        w[j * kTq + t] = t < tokens ? p.index_scale * p.weights.at(row0 + t, j, 0) : 0.0f;
    }
  }

  // A tiles of key head kh for keys [k0, k0 + n) of the sequence; partial tiles
  // are gathered (zero rows past n) so no load reads past the tensor.
  void key_tiles(const core::SequenceSlice& seq, int64_t k0, int64_t n, int64_t kh, ATiles& a) {
    const int64_t r0 = seq.k_begin + k0;
    a.chunks = qchunks;
    if (n == kTk) {
      for (int64_t c = 0; c < dmain / kChunk; ++c) {
        a.ptr[c] = reinterpret_cast<const std::uint16_t*>(p.key.bytes(r0, kh)) + c * kChunk;
        a.stride[c] = p.key.row_stride;
      }
      for (int64_t c = 0; c < drope / kChunk; ++c) {
        a.ptr[dmain / kChunk + c] = reinterpret_cast<const std::uint16_t*>(p.key_rope.bytes(r0, kh)) + c * kChunk;
        a.stride[dmain / kChunk + c] = p.key_rope.row_stride;
      }
      return;
    }
    for (int64_t s = 0; s < kTk; ++s) {
      std::uint16_t* dst = kbuf + s * dq;
      if (s < n) {
        std::memcpy(dst, p.key.bytes(r0 + s, kh), dmain * 2);
        if (drope) std::memcpy(dst + dmain, p.key_rope.bytes(r0 + s, kh), drope * 2);
      } else {
        std::memset(dst, 0, dq * 2);
      }
    }
    for (int64_t c = 0; c < qchunks; ++c) {
      a.ptr[c] = kbuf + c * kChunk;
      a.stride[c] = dq;
    }
  }

  const std::uint16_t* index_key_rows(const core::SequenceSlice& seq, int64_t k0, int64_t n, int64_t& stride) {
    const int64_t r0 = seq.k_begin + k0;
    if (n == kTk) {
      stride = p.index_key.row_stride;
      return reinterpret_cast<const std::uint16_t*>(p.index_key.bytes(r0, 0));
    }
    for (int64_t s = 0; s < kTk; ++s) {
      if (s < n) std::memcpy(ikbuf + s * idim, p.index_key.bytes(r0 + s, 0), idim * 2);
      else std::memset(ikbuf + s * idim, 0, idim * 2);
    }
    stride = idim;
    return ikbuf;
  }

  // Teacher pT, student scores and (with_grad) g for keys [k0, k0 + n).
  // Pairs outside the loss (invisible, padding, uncounted rows) get p 0 and g 0.
  // Returns the index key rows used (for the backward GEMMs).
  const std::uint16_t* compute(const core::SequenceSlice& seq, int64_t k0, int64_t n, bool with_grad, float factor,
                               int64_t& ik_stride) {
    const __m512 zero = _mm512_setzero_ps(), scale = _mm512_set1_ps(p.scale);
    std::memset(pT, 0, sizeof(pT));
    std::memset(score, 0, sizeof(score));
    ATiles a;
    int64_t gathered = -1;
    for (int64_t h = 0; h < heads; ++h) {
      if (!any_live[h]) continue;
      const int64_t kh = h / group;
      if (kh != gathered) {
        key_tiles(seq, k0, n, kh, a);
        gathered = kh;
      }
      tile_gemm_32x32(a, qpack + h * qchunks * 512, cbuf);
      const __m512 mx0 = _mm512_loadu_ps(&max[h * kTq]), mx1 = _mm512_loadu_ps(&max[h * kTq + 16]);
      const __m512 iv0 = _mm512_loadu_ps(&inv[h * kTq]), iv1 = _mm512_loadu_ps(&inv[h * kTq + 16]);
      // Tokens for which the head was empty in the forward (inv 0) add nothing:
      // not 0 * a NaN logit, as the reference skips them.
      const __mmask16 live0 = _mm512_cmp_ps_mask(iv0, _mm512_setzero_ps(), _CMP_NEQ_OQ);
      const __mmask16 live1 = _mm512_cmp_ps_mask(iv1, _mm512_setzero_ps(), _CMP_NEQ_OQ);
      for (int64_t s = 0; s < kTk; ++s) {
        const __m512 x0 = _mm512_fmsub_ps(scale, _mm512_load_ps(cbuf + s * kTq), mx0);
        const __m512 x1 = _mm512_fmsub_ps(scale, _mm512_load_ps(cbuf + s * kTq + 16), mx1);
        _mm512_store_ps(&pT[s][0], _mm512_mask3_fmadd_ps(exp512(x0), iv0, _mm512_load_ps(&pT[s][0]), live0));
        _mm512_store_ps(&pT[s][16], _mm512_mask3_fmadd_ps(exp512(x1), iv1, _mm512_load_ps(&pT[s][16]), live1));
      }
    }
    const std::uint16_t* ik = index_key_rows(seq, k0, n, ik_stride);
    ATiles ia;
    ia.chunks = ichunks;
    for (int64_t c = 0; c < ichunks; ++c) {
      ia.ptr[c] = ik + c * kChunk;
      ia.stride[c] = ik_stride;
    }
    for (int64_t j = 0; j < iheads; ++j) {
      float* c = dots ? dots + j * kTk * kTq : cbuf;
      tile_gemm_32x32(ia, ipack + j * ichunks * 512, c);
      const __m512 w0 = _mm512_loadu_ps(&w[j * kTq]), w1 = _mm512_loadu_ps(&w[j * kTq + 16]);
      for (int64_t s = 0; s < kTk; ++s) {
        const __m512 d0 = _mm512_load_ps(c + s * kTq), d1 = _mm512_load_ps(c + s * kTq + 16);
        const __m512 r0 = _mm512_max_ps(zero, d0), r1 = _mm512_max_ps(zero, d1);  // relu keeping NaN
        _mm512_store_ps(&score[s][0], _mm512_fmadd_ps(w0, r0, _mm512_load_ps(&score[s][0])));
        _mm512_store_ps(&score[s][16], _mm512_fmadd_ps(w1, r1, _mm512_load_ps(&score[s][16])));
      }
    }
    const __m512 inv_heads = _mm512_set1_ps(1.0f / static_cast<float>(heads)), vf = _mm512_set1_ps(factor);
    const __m512i lim0 = _mm512_load_si512(limit), lim1 = _mm512_load_si512(limit + 16);
    const __m512 l0 = _mm512_load_ps(lse), l1 = _mm512_load_ps(lse + 16);
    for (int64_t s = 0; s < kTk; ++s) {
      const __m512i key = _mm512_set1_epi32(static_cast<std::int32_t>(k0 + s));
      const __mmask16 m0 = s < n ? _mm512_cmp_epi32_mask(key, lim0, _MM_CMPINT_LT) : 0;
      const __mmask16 m1 = s < n ? _mm512_cmp_epi32_mask(key, lim1, _MM_CMPINT_LT) : 0;
      const __m512 p0 = _mm512_maskz_mul_ps(m0, _mm512_load_ps(&pT[s][0]), inv_heads);
      const __m512 p1 = _mm512_maskz_mul_ps(m1, _mm512_load_ps(&pT[s][16]), inv_heads);
      _mm512_store_ps(&pT[s][0], p0);
      _mm512_store_ps(&pT[s][16], p1);
      if (with_grad) {
        const __m512 st0 = exp512(_mm512_sub_ps(_mm512_load_ps(&score[s][0]), l0));
        const __m512 st1 = exp512(_mm512_sub_ps(_mm512_load_ps(&score[s][16]), l1));
        _mm512_store_ps(&g[s][0], _mm512_maskz_mul_ps(m0, vf, _mm512_sub_ps(st0, p0)));
        _mm512_store_ps(&g[s][16], _mm512_maskz_mul_ps(m1, vf, _mm512_sub_ps(st1, p1)));
      }
    }
    return ik;
  }

  // KL terms of the current tile, added per token: sum_s p (log p - (score - lse)).
  void add_kl(double* kl) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const __m512 l0 = _mm512_load_ps(lse), l1 = _mm512_load_ps(lse + 16), tiny = _mm512_set1_ps(1e-37f);
    for (int64_t s = 0; s < kTk; ++s) {
      const __m512 p0 = _mm512_load_ps(&pT[s][0]), p1 = _mm512_load_ps(&pT[s][16]);
      // p log p -> 0 as p -> 0; below the normal range the term is under 1e-36.
      // (NLT_UQ: a NaN p is added.)
      const __mmask16 k0 = _mm512_cmp_ps_mask(p0, tiny, _CMP_NLT_UQ), k1 = _mm512_cmp_ps_mask(p1, tiny, _CMP_NLT_UQ);
      const __m512 ls0 = _mm512_sub_ps(_mm512_load_ps(&score[s][0]), l0);
      const __m512 ls1 = _mm512_sub_ps(_mm512_load_ps(&score[s][16]), l1);
      acc0 = _mm512_mask_add_ps(acc0, k0, acc0, _mm512_mul_ps(p0, _mm512_sub_ps(log512(p0), ls0)));
      acc1 = _mm512_mask_add_ps(acc1, k1, acc1, _mm512_mul_ps(p1, _mm512_sub_ps(log512(p1), ls1)));
    }
    alignas(64) float lanes[kTq];
    _mm512_store_ps(lanes, acc0);
    _mm512_store_ps(lanes + 16, acc1);
    for (int64_t t = 0; t < kTq; ++t) kl[t] += lanes[t];
  }

  // coef_j[s][t] = g * w_j * [dot_j > 0] for head j (rows of 32 tokens, two vectors).
  inline void coef_row(int64_t j, int64_t s, __m512& c0, __m512& c1) const {
    const float* d = dots + j * kTk * kTq + s * kTq;
    const __m512 zero = _mm512_setzero_ps();
    const __mmask16 pos0 = _mm512_cmp_ps_mask(_mm512_load_ps(d), zero, _CMP_GT_OQ);
    const __mmask16 pos1 = _mm512_cmp_ps_mask(_mm512_load_ps(d + 16), zero, _CMP_GT_OQ);
    c0 = _mm512_maskz_mul_ps(pos0, _mm512_load_ps(&g[s][0]), _mm512_loadu_ps(&w[j * kTq]));
    c1 = _mm512_maskz_mul_ps(pos1, _mm512_load_ps(&g[s][16]), _mm512_loadu_ps(&w[j * kTq + 16]));
  }
};

void dense_fwd(const DenseKlProblem& p) {
  const std::vector<QueryTask> tasks = query_tasks(p.plan);
  std::vector<double> row_kl(p.plan.q_rows, 0.0);
  const int threads = thread_count(static_cast<int64_t>(tasks.size()), p.num_threads);
  std::vector<Block> blocks;
  blocks.reserve(threads);
  for (int t = 0; t < threads; ++t) blocks.emplace_back(p, false);
  core::parallel_for(static_cast<int64_t>(tasks.size()), threads, [&](int64_t task_index, int thread) {
    const QueryTask& task = tasks[task_index];
    const auto& seq = p.plan.seqs[task.seq];
    Block& b = blocks[thread];
    configure_tiles();
    b.load_queries(seq, task.first, task.tokens);
    double kl[kTq] = {};
    int64_t stride;
    for (int64_t k0 = 0; k0 < b.last; k0 += kTk) {
      b.compute(seq, k0, std::min(kTk, b.last - k0), false, 0.0f, stride);
      b.add_kl(kl);
    }
    for (int64_t t = 0; t < b.tokens; ++t) row_kl[b.row0 + t] = kl[t];
    release_tiles();
  });
  double total = 0.0;
  for (double v : row_kl) total += v;
  *p.loss = static_cast<float>(reduction_factor(p.reduction, p.coefficient, counted_rows(p)) * total);
}

void dense_bwd(const DenseKlProblem& p) {
  const float factor = static_cast<float>(p.grad_loss * reduction_factor(p.reduction, p.coefficient, counted_rows(p)));
  const DType wdt = p.weights.dtype;
  const int64_t iheads = p.index_query.heads, idim = p.index_query.dim, dgroups = idim / 16;
  std::memset(p.d_index_query, 0, p.plan.q_rows * iheads * idim * 2);
  std::memset(p.d_weights, 0, p.plan.q_rows * iheads * dtype_size(wdt));
  std::memset(p.d_index_key, 0, p.key_rows * idim * 2);

  // dQ, dW: tasks own query blocks and stream the key tiles they see.
  {
    const std::vector<QueryTask> tasks = query_tasks(p.plan);
    const int threads = thread_count(static_cast<int64_t>(tasks.size()), p.num_threads);
    std::vector<Block> blocks;
    blocks.reserve(threads);
    for (int t = 0; t < threads; ++t) blocks.emplace_back(p, true);
    struct Scratch {
      core::ScratchVector<std::uint8_t> dqt, ikt, cvnni;
      std::vector<float> dw;
    };
    std::vector<Scratch> scratch(threads);
    for (auto& s : scratch) {
      s.dqt.resize(iheads * idim * kTq * 4 + 64);  // dQ_j^T [Hi][Di][32 tokens] fp32
      s.ikt.resize(idim * kDqTiles * kTk * 2 + 64);  // ik^T [Di][kDqTiles * 32 keys] bf16
      s.cvnni.resize(iheads * kDqTiles * 2048 + 64);  // coef_j B tiles [Hi][kDqTiles][2][256] u32
      s.dw.resize(iheads * kTq);
    }
    core::parallel_for(static_cast<int64_t>(tasks.size()), threads, [&](int64_t task_index, int thread) {
      const QueryTask& task = tasks[task_index];
      const auto& seq = p.plan.seqs[task.seq];
      Block& b = blocks[thread];
      Scratch& sc = scratch[thread];
      float* dqt = align64<float>(sc.dqt);
      auto* ikt = align64<std::uint16_t>(sc.ikt);
      float* dw = sc.dw.data();
      std::memset(dqt, 0, iheads * idim * kTq * 4);
      std::fill(sc.dw.begin(), sc.dw.end(), 0.0f);
      configure_tiles();
      b.load_queries(seq, task.first, task.tokens);
      auto* cvnni = align64<std::uint32_t>(sc.cvnni);
      constexpr int64_t kWide = kDqTiles * kTk;
      // dQ_j^T += ik^T x coef_j over the buffered tiles: kDqTiles products per
      // load/store of each C tile (the accumulator is the L2 traffic).
      auto flush = [&](int64_t count) { dq_flush(dqt, ikt, cvnni, iheads, idim, count); };
      int64_t buffered = 0;
      for (int64_t k0 = 0; k0 < b.last; k0 += kTk) {
        const int64_t n = std::min(kTk, b.last - k0);
        int64_t ik_stride;
        const std::uint16_t* ik = b.compute(seq, k0, n, true, factor, ik_stride);
        for (int64_t d = 0; d < idim; ++d)
          for (int64_t s = 0; s < kTk; ++s) ikt[d * kWide + buffered * kTk + s] = ik[s * ik_stride + d];
        for (int64_t j = 0; j < iheads; ++j) {
          const float* dj = b.dots + j * kTk * kTq;
          __m512 dw0 = _mm512_loadu_ps(dw + j * kTq), dw1 = _mm512_loadu_ps(dw + j * kTq + 16);
          const __m512 zero = _mm512_setzero_ps();
          for (int64_t s = 0; s < kTk; ++s) {
            const __m512 d0 = _mm512_load_ps(dj + s * kTq), d1 = _mm512_load_ps(dj + s * kTq + 16);
            dw0 = _mm512_fmadd_ps(_mm512_load_ps(&b.g[s][0]), _mm512_max_ps(zero, d0), dw0);
            dw1 = _mm512_fmadd_ps(_mm512_load_ps(&b.g[s][16]), _mm512_max_ps(zero, d1), dw1);
          }
          _mm512_storeu_ps(dw + j * kTq, dw0);
          _mm512_storeu_ps(dw + j * kTq + 16, dw1);
          // B: coef_j as VNNI key pairs x 16 tokens, one tile per token group.
          std::uint32_t* bv = cvnni + (j * kDqTiles + buffered) * 512;
          for (int64_t r = 0; r < 16; ++r) {
            __m512 a0, a1, c0, c1;
            b.coef_row(j, 2 * r, a0, a1);
            b.coef_row(j, 2 * r + 1, c0, c1);
            _mm512_store_si512(bv + r * 16, pair_rows_bf16(a0, c0));
            _mm512_store_si512(bv + 256 + r * 16, pair_rows_bf16(a1, c1));
          }
        }
        if (++buffered == kDqTiles) {
          flush(buffered);
          buffered = 0;
        }
      }
      if (buffered) flush(buffered);
      release_tiles();
      auto* dq_out = static_cast<std::uint16_t*>(p.d_index_query);
      alignas(64) float row[1024];
      for (int64_t t = 0; t < b.tokens; ++t)
        for (int64_t j = 0; j < iheads; ++j) {
          const float* cj = dqt + j * idim * kTq;
          for (int64_t d = 0; d < idim; ++d) row[d] = cj[d * kTq + t];
          for (int64_t d = 0; d < idim; d += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dq_out + ((b.row0 + t) * iheads + j) * idim + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + d)));
          core::store_float(p.d_weights, wdt, (b.row0 + t) * iheads + j, dw[j * kTq + t] * p.index_scale);
        }
    });
  }

  // dK: tasks own kDkTiles 32-key tiles and stream the query blocks that see them
  // (the query block's iq is packed once for all of the task's tiles).
  struct KeyTask {
    int64_t seq, k0, n, cost;
  };
  std::vector<KeyTask> tasks;
  for (int64_t bi = 0; bi < static_cast<int64_t>(p.plan.seqs.size()); ++bi) {
    const auto& seq = p.plan.seqs[bi];
    if (seq.q_len == 0) continue;
    const int64_t offset = seq.k_len - seq.q_len;  // query i sees keys <= offset + i
    for (int64_t k0 = 0; k0 < seq.k_len; k0 += kTk * kDkTiles) {
      const int64_t first_query = std::max<int64_t>(0, k0 - offset);
      if (first_query >= seq.q_len) continue;
      tasks.push_back({bi, k0, std::min(kTk * kDkTiles, seq.k_len - k0), seq.q_len - first_query});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const KeyTask& a, const KeyTask& b) { return a.cost > b.cost; });
  const int threads = thread_count(static_cast<int64_t>(tasks.size()), p.num_threads);
  std::vector<Block> blocks;
  blocks.reserve(threads);
  for (int t = 0; t < threads; ++t) blocks.emplace_back(p, true);
  struct Scratch {
    core::ScratchVector<std::uint8_t> dk, coef, ivnni;
  };
  std::vector<Scratch> scratch(threads);
  for (auto& s : scratch) {
    s.dk.resize(kDkTiles * kTk * idim * 4 + 64);     // [task keys][Di] fp32
    s.coef.resize(iheads * kTk * kTq * 2 + 64);      // A: coef_j [32 keys][32 tokens] bf16
    s.ivnni.resize(iheads * dgroups * 1024 + 64);    // B: iq_j token pairs x 16 dims
  }
  core::parallel_for(static_cast<int64_t>(tasks.size()), threads, [&](int64_t task_index, int thread) {
    const KeyTask& task = tasks[task_index];
    const auto& seq = p.plan.seqs[task.seq];
    Block& b = blocks[thread];
    Scratch& sc = scratch[thread];
    float* dk = align64<float>(sc.dk);
    auto* coef = align64<std::uint16_t>(sc.coef);
    auto* ivnni = align64<std::uint32_t>(sc.ivnni);
    std::memset(dk, 0, kDkTiles * kTk * idim * 4);
    configure_tiles();
    const int64_t offset = seq.k_len - seq.q_len;
    const int64_t first_query = std::max<int64_t>(0, task.k0 - offset);
    for (int64_t first = first_query / kTq * kTq; first < seq.q_len; first += kTq) {
      b.load_queries(seq, first, std::min(kTq, seq.q_len - first));
      for (int64_t j = 0; j < iheads; ++j) {
        const auto* iq = reinterpret_cast<const std::uint16_t*>(p.index_query.bytes(b.row0, j));
        const __m512 zero = _mm512_setzero_ps();
        auto load = [&](int64_t tt, int64_t dg) {
          if (tt >= b.tokens) return zero;
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(iq + tt * p.index_query.row_stride + dg * 16));
          return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
        };
        // bf16 -> fp32 -> bf16 is exact; reuses the fp32 pair interleave.
        for (int64_t dg = 0; dg < dgroups; ++dg)
          for (int64_t r = 0; r < 16; ++r)
            _mm512_store_si512(ivnni + (j * dgroups + dg) * 256 + r * 16, pair_rows_bf16(load(2 * r, dg), load(2 * r + 1, dg)));
      }
      for (int64_t sub = 0; sub * kTk < task.n; ++sub) {
        const int64_t k0 = task.k0 + sub * kTk, n = std::min(kTk, task.n - sub * kTk);
        if (k0 >= b.last) break;  // no token of the block sees these keys
        int64_t ik_stride;
        b.compute(seq, k0, n, true, factor, ik_stride);
        for (int64_t j = 0; j < iheads; ++j)
          for (int64_t s = 0; s < kTk; ++s) {
            __m512 c0, c1;
            b.coef_row(j, s, c0, c1);
            _mm512_store_si512(coef + (j * kTk + s) * kTq, (__m512i)_mm512_cvtne2ps_pbh(c1, c0));
          }
        dk_update(dk + sub * kTk * idim, idim, coef, ivnni, iheads);
      }
    }
    release_tiles();
    auto* dk_out = static_cast<std::uint16_t*>(p.d_index_key) + (seq.k_begin + task.k0) * idim;
    for (int64_t s = 0; s < task.n; ++s)
      for (int64_t d = 0; d < idim; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dk_out + s * idim + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(dk + s * idim + d)));
  });
}

}  // namespace

const DenseKlKernels& DSA_KL_DENSE_KERNELS() {
  static const DenseKlKernels kernels{DSA_KL_LABEL, dense_fwd, dense_bwd};
  return kernels;
}

}  // namespace dsa::cpu::kl_kernels
