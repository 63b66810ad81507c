// Kernels of the sparse KL loss (docs/ops.md 4.3) on bf16 pairs, bf16 inputs,
// shared by kl_amx.cpp (products on AMX tiles) and kl_avx512bf16.cpp (the same
// products on vdpbf16ps, cpu/isa/avx512bf16_gemm.h). The engine includes this
// file and then defines, in dsa::cpu::kl_kernels' anonymous namespace, the
// hooks declared below ("Products"); DSA_KL_SPARSE_KERNELS names its kernel table.
// One algorithm, two engines: packing, epilogues and every accumulation order
// outside the products are shared.
//
// Per query row the work is a set of small GEMMs against the row's gathered
// entries, taken 32 at a time (one "entry block"):
//   teacher logits  C[e][h] = kv[idx_e] . q[h]       [32 x Dq] x [Dq x H]
//   indexer dots    C[e][j] = ik[idx_e] . iq[j]      [32 x Di] x [Di x Hi]
// The gathered rows are the A operand, loaded straight from a contiguous copy;
// the row's heads are the B operand, packed to the VNNI pair layout once per
// row (a 16x16 transpose of 32-bit dim pairs), so nothing is transposed per
// entry. C tiles hold 16 entries x 16 heads; the epilogues (exp for the
// teacher, weighted ReLU for the student) run on them in AVX-512 with heads in
// the lanes and end in one fixed-order horizontal sum per entry.
//
// Backward, per row, with coef[e][j] = g_e * w_j * index_scale * [dot > 0]:
//   dW[j]  = index_scale * sum_e g_e relu(dot[e][j])     (C-tile epilogue)
//   dQ     = coef^T [Hi x 32] x ik_block [32 x Di]        (accumulated in C tiles
//                                                          loaded from an fp32 row buffer)
//   dK_e   = coef [32 x Hi] x iq [Hi x Di]                 (per entry, scattered)
// dK is a scatter over keys; to keep every sum in a fixed order, rows are cut
// into fixed blocks of kBwdRows rows (independent of the thread count), each
// block scatters into its own fp32 partial over the keys, and the partials are
// added to the result in block order. At most `threads` partials live at once.
// gcc 12 reports the intrinsics' own _mm512_undefined_* placeholders as
// "maybe uninitialized" once they are inlined here; the warning is spurious.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/memory.h"
#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/kl_loss/kl_kernels.h"
#include "cpu/kl_loss/kl_sparse_rows.h"
#include "cpu/isa/kl_pairs_common.h"

namespace dsa::cpu::kl_kernels {
namespace {

using std::int64_t;
using namespace pairs;

constexpr int64_t kBlock = 32;   // entries per block: two 16-row A tiles
constexpr int64_t kChunk = kPairChunk;  // bf16 elements per 64-byte tile row
constexpr int64_t kSparseRows = 4;  // forward: rows per task
constexpr int64_t kBwdRows = 32;    // backward: rows per dK block (fixed: results never depend on threads)

// B operand from a row's heads: tile (chunk c, head group g) row r holds, for
// heads 16g..16g+15, the dim pair (32c + 2r, 32c + 2r + 1). out: [chunks][groups][256] u32.
void pack_heads_vnni(const std::uint16_t* head0, int64_t head_stride, int64_t heads, int64_t chunks,
                     int64_t chunk_offset, std::uint32_t* out) {
  const int64_t groups = heads / 16;
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t g = 0; g < groups; ++g) {
      __m512i r[16];
      for (int h = 0; h < 16; ++h) r[h] = _mm512_loadu_si512(head0 + (g * 16 + h) * head_stride + c * kChunk);
      transpose16x16(r);
      std::uint32_t* tile = out + ((chunk_offset + c) * groups + g) * 256;
      for (int row = 0; row < 16; ++row) _mm512_store_si512(tile + row * 16, r[row]);
    }
}

// B operand with K along rows of a [rows x dim] bf16 matrix (rows 2r, 2r+1 of
// a 32-row slab interleaved) and N = 16 dims: tile (slab s, dim group n) at
// out[(s * (dim / 16) + n) * 256].
inline void pack_rows_vnni(const std::uint16_t* m, int64_t row_stride, int64_t slabs, int64_t dim,
                           std::uint32_t* out) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t groups = dim / 16;
  for (int64_t s = 0; s < slabs; ++s)
    for (int64_t n = 0; n < groups; ++n) {
      std::uint32_t* tile = out + (s * groups + n) * 256;
      for (int r = 0; r < 16; ++r) {
        const std::uint16_t* lo = m + (s * 32 + 2 * r) * row_stride + n * 16;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + row_stride));
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_store_si512(tile + r * 16, _mm512_permutexvar_epi16(interleave, ab));
      }
    }
}


int thread_count(int64_t n_tasks, int num_threads) {
  return std::max(1, static_cast<int>(std::min<int64_t>(std::max<int64_t>(n_tasks, 1), num_threads)));
}

// Gathers `m` rows (<= kBlock) of a [.., dim] bf16 matrix into a [kBlock][width]
// buffer at column `col`; rows past m are zero.
void gather_rows(const HeadMatrix& src, const int64_t* key_rows, int64_t m, int64_t width, int64_t col,
                 std::uint16_t* out) {
  for (int64_t e = 0; e < kBlock; ++e) {
    std::uint16_t* dst = out + e * width + col;
    if (e < m) std::memcpy(dst, src.bytes(key_rows[e], 0), src.dim * 2);
    else std::memset(dst, 0, src.dim * 2);
  }
}

// Asks for the rows of the next entry block while the current one computes:
// the gathers are random reads of kv rows, the latency the tiles would wait on.
void prefetch_rows(const HeadMatrix& src, const int64_t* key_rows, int64_t m) {
  const int64_t bytes = src.dim * 2;
  for (int64_t e = 0; e < m; ++e) {
    const char* row = src.bytes(key_rows[e], 0);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// Products (the engine's hooks; every operand in the AMX tile layouts):
//   configure_tiles() / release_tiles()   per-thread set-up and tear-down of a task
//   block_gemm(a, chunks, b, groups, cbuf, epilogue): C[e][h] for the 32 entries
//     of `a` ([kBlock][chunks * 32] bf16) against the packed heads `b`
//     ([chunks][groups][256] u32), handed to epilogue(group, c) in group order
//     with c = [32 entries][16 heads] fp32 at cbuf (pairs of groups: the second
//     at cbuf + 512);
//   dq_update(dqacc, idim, adq, bdq, igroups, dgroups): dqacc [Hi][Di] fp32 +=
//     adq [Hi][32 entries] . bdq (one 32-entry slab, [dgroups][256] u32);
//   dk_contrib(contrib, idim, adk, ih, ihc, dgroups): contrib [32 entries][Di]
//     fp32 = sum over 32-head chunks hc of adk [hc][32 entries][32 heads] .
//     ih ([ihc][dgroups][256] u32).
void configure_tiles();
void release_tiles();
template <class Epilogue>
void block_gemm(const std::uint16_t* a, int64_t chunks, const std::uint32_t* b, int64_t groups, float* cbuf,
                const Epilogue& epilogue);
void dq_update(float* dqacc, int64_t idim, const std::uint16_t* adq, const std::uint32_t* bdq, int64_t igroups,
               int64_t dgroups);
void dk_contrib(float* contrib, int64_t idim, const std::uint16_t* adk, const std::uint32_t* ih, int64_t ihc,
                int64_t dgroups);

// The forward statistics of one row as per-head lanes; empty heads (max -inf or
// sum 0) contribute nothing: their lanes are masked off.
struct TeacherHeads {
  std::vector<float> max, inv;
  std::vector<__mmask16> live;
};

void sparse_fwd(const SparseKlProblem& p) {
  const int64_t heads = p.query.heads, hgroups = heads / 16;
  const int64_t dmain = p.query.dim, drope = p.query_rope.present() ? p.query_rope.dim : 0, dq = dmain + drope;
  const int64_t qchunks = dq / kChunk;
  const int64_t iheads = p.index_query.heads, igroups = iheads / 16, idim = p.index_query.dim;
  const int64_t ichunks = idim / kChunk, topk = p.topk;
  const std::vector<RowRef> rows = sequence_rows(p.plan);
  std::vector<double> row_kl(p.plan.q_rows, 0.0);
  std::vector<char> counted(p.plan.q_rows, 0);
  if (p.score_grad) std::fill(p.score_grad, p.score_grad + p.plan.q_rows * topk, 0.0f);

  const int64_t n_tasks = (static_cast<int64_t>(rows.size()) + kSparseRows - 1) / kSparseRows;
  const int threads = thread_count(n_tasks, p.num_threads);
  struct Scratch {
    core::ScratchVector<std::uint8_t> qb, ib, kvbuf, ikbuf, cbuf;
    std::vector<float> max, inv, w, teacher, score, acc;
    std::vector<__mmask16> live;
    std::vector<int64_t> slots, key_rows;
  };
  std::vector<Scratch> scratch(threads);
  for (auto& s : scratch) {
    s.qb.resize(qchunks * hgroups * 1024 + 64);
    s.ib.resize(ichunks * igroups * 1024 + 64);
    s.kvbuf.resize(kBlock * dq * 2 + 64);
    s.ikbuf.resize(kBlock * idim * 2 + 64);
    s.cbuf.resize(4 * 1024 + 64);
    s.max.resize(heads);
    s.inv.resize(heads);
    s.live.resize(hgroups);
    s.w.resize(iheads);
    s.teacher.resize(topk + kBlock);
    s.score.resize(topk + kBlock);
    s.acc.resize(kBlock * 16);
    s.slots.resize(topk);
    s.key_rows.resize(topk + kBlock);
  }

  core::parallel_for(n_tasks, threads, [&](int64_t task, int thread) {
    Scratch& s = scratch[thread];
    configure_tiles();
    auto* qb = align64<std::uint32_t>(s.qb);
    auto* ib = align64<std::uint32_t>(s.ib);
    auto* kvbuf = align64<std::uint16_t>(s.kvbuf);
    auto* ikbuf = align64<std::uint16_t>(s.ikbuf);
    auto* cbuf = align64<float>(s.cbuf);
    const int64_t end = std::min<int64_t>(rows.size(), (task + 1) * kSparseRows);
    for (int64_t r = task * kSparseRows; r < end; ++r) {
      const auto& seq = p.plan.seqs[rows[r].seq];
      const int64_t i = rows[r].i, row = seq.q_begin + i;
      const int64_t n = valid_entries(p, seq, i, s.slots.data(), s.key_rows.data());
      if (n == 0) continue;
      counted[row] = 1;
      pack_heads_vnni(reinterpret_cast<const std::uint16_t*>(p.query.bytes(row, 0)), p.query.head_stride, heads,
                      dmain / kChunk, 0, qb);
      if (drope)
        pack_heads_vnni(reinterpret_cast<const std::uint16_t*>(p.query_rope.bytes(row, 0)),
                        p.query_rope.head_stride, heads, drope / kChunk, dmain / kChunk, qb);
      pack_heads_vnni(reinterpret_cast<const std::uint16_t*>(p.index_query.bytes(row, 0)),
                      p.index_query.head_stride, iheads, ichunks, 0, ib);
      for (int64_t j = 0; j < iheads; ++j) s.w[j] = p.index_scale * p.weights.at(row, j, 0);
      for (int64_t g = 0; g < hgroups; ++g) s.live[g] = 0;
      for (int64_t h = 0; h < heads; ++h) {
        const float mx = p.softmax_max[row * heads + h], sum = p.softmax_sum[row * heads + h];
        const bool live = mx != core::kNegInf && !(sum <= 0.0f);  // NaN statistics reach the teacher
        s.max[h] = live ? mx : 0.0f;
        s.inv[h] = live ? 1.0f / (sum + (p.sinks ? std::exp(p.sinks[h] - mx) : 0.0f)) : 0.0f;
        if (live) s.live[h / 16] |= static_cast<__mmask16>(1u << (h % 16));
      }
      const __m512 scale = _mm512_set1_ps(p.scale);
      for (int64_t c0 = 0; c0 < n; c0 += kBlock) {
        const int64_t m = std::min(kBlock, n - c0);
        gather_rows(p.kv, s.key_rows.data() + c0, m, dq, 0, kvbuf);
        if (drope) gather_rows(p.key_rope, s.key_rows.data() + c0, m, dq, dmain, kvbuf);
        gather_rows(p.index_key, s.key_rows.data() + c0, m, idim, 0, ikbuf);
        if (c0 + kBlock < n) {
          const int64_t next = std::min(kBlock, n - c0 - kBlock);
          prefetch_rows(p.kv, s.key_rows.data() + c0 + kBlock, next);
          if (drope) prefetch_rows(p.key_rope, s.key_rows.data() + c0 + kBlock, next);
          prefetch_rows(p.index_key, s.key_rows.data() + c0 + kBlock, next);
        }
        float* acc = s.acc.data();
        std::memset(acc, 0, sizeof(float) * kBlock * 16);
        // Teacher: sum over heads of exp(scale * logit - max) / denominator.
        block_gemm(kvbuf, qchunks, qb, hgroups, cbuf, [&](int64_t g, const float* c) {
          const __m512 mx = _mm512_loadu_ps(s.max.data() + g * 16), inv = _mm512_loadu_ps(s.inv.data() + g * 16);
          const __mmask16 live = s.live[g];
          for (int64_t e = 0; e < kBlock; ++e) {
            const __m512 x = _mm512_fmsub_ps(scale, _mm512_load_ps(c + e * 16), mx);
            const __m512 v = _mm512_maskz_mul_ps(live, exp512(x), inv);
            _mm512_storeu_ps(acc + e * 16, _mm512_add_ps(_mm512_loadu_ps(acc + e * 16), v));
          }
        });
        for (int64_t e = 0; e < m; ++e) s.teacher[c0 + e] = _mm512_reduce_add_ps(_mm512_loadu_ps(acc + e * 16));
        // Student scores: sum over indexer heads of w * relu(dot).
        std::memset(acc, 0, sizeof(float) * kBlock * 16);
        block_gemm(ikbuf, ichunks, ib, igroups, cbuf, [&](int64_t g, const float* c) {
          const __m512 w = _mm512_loadu_ps(s.w.data() + g * 16), zero = _mm512_setzero_ps();
          for (int64_t e = 0; e < kBlock; ++e) {
            const __m512 d = _mm512_load_ps(c + e * 16);
            const __m512 relu = _mm512_max_ps(zero, d);  // keeps NaN (d is the second operand)
            _mm512_storeu_ps(acc + e * 16, _mm512_fmadd_ps(w, relu, _mm512_loadu_ps(acc + e * 16)));
          }
        });
        for (int64_t e = 0; e < m; ++e) s.score[c0 + e] = _mm512_reduce_add_ps(_mm512_loadu_ps(acc + e * 16));
      }
      double mass = 0.0;
      float max_score = core::kNegInf;
      for (int64_t e = 0; e < n; ++e) {
        mass += s.teacher[e];
        max_score = std::max(max_score, s.score[e]);
      }
      // No teacher mass: KL 0 and gradient (sum p) * student - p = 0.
      if (mass <= 0.0) continue;  // (a NaN mass is counted: its NaN reaches the loss)
      // Row epilogue in lanes of 16 entries; sums in a fixed lane order.
      const int64_t n16 = (n + 15) / 16 * 16;
      for (int64_t e = n; e < n16; ++e) {
        s.teacher[e] = 0.0f;
        s.score[e] = core::kNegInf;
      }
      __m512 z = _mm512_setzero_ps();
      const __m512 vmax = _mm512_set1_ps(max_score);
      for (int64_t e = 0; e < n16; e += 16)
        z = _mm512_add_ps(z, exp512(_mm512_sub_ps(_mm512_loadu_ps(s.score.data() + e), vmax)));
      const float lse = static_cast<float>(max_score + std::log(static_cast<double>(_mm512_reduce_add_ps(z))));
      const __m512 vlse = _mm512_set1_ps(lse), inv_mass = _mm512_set1_ps(static_cast<float>(1.0 / mass));
      __m512 kl = _mm512_setzero_ps();
      float* grad = p.score_grad ? p.score_grad + row * topk : nullptr;
      alignas(64) float student_minus_p[16];
      for (int64_t e = 0; e < n16; e += 16) {
        const __m512 pe = _mm512_mul_ps(_mm512_loadu_ps(s.teacher.data() + e), inv_mass);
        const __m512 log_student = _mm512_sub_ps(_mm512_loadu_ps(s.score.data() + e), vlse);
        const __mmask16 pos = _mm512_cmp_ps_mask(pe, _mm512_setzero_ps(), _CMP_NEQ_UQ);  // 0 log 0 = 0; NaN is added
        const __m512 term = _mm512_mul_ps(pe, _mm512_sub_ps(log512(pe), log_student));
        kl = _mm512_add_ps(kl, _mm512_maskz_mov_ps(pos, term));
        if (grad) {
          _mm512_store_ps(student_minus_p, _mm512_sub_ps(exp512(log_student), pe));
          for (int64_t l = 0; l < 16 && e + l < n; ++l) grad[s.slots[e + l]] = student_minus_p[l];
        }
      }
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, kl);
      double total = 0.0;
      for (float v : lanes) total += v;
      row_kl[row] = total;
    }
    release_tiles();
  });

  finish_sparse_loss(p, counted, row_kl);
}

void sparse_bwd(const SparseKlBackwardProblem& p) {
  const int64_t iheads = p.index_query.heads, igroups = iheads / 16, ihc = iheads / 32;
  const int64_t idim = p.index_query.dim, ichunks = idim / kChunk, dgroups = idim / 16, topk = p.topk;
  const DType wdt = p.weights.dtype;
  const std::vector<RowRef> rows = sequence_rows(p.plan);
  std::memset(p.d_index_query, 0, p.plan.q_rows * iheads * idim * 2);
  std::memset(p.d_weights, 0, p.plan.q_rows * iheads * dtype_size(wdt));
  const float is = p.index_scale;

  const int64_t n_blocks = (static_cast<int64_t>(rows.size()) + kBwdRows - 1) / kBwdRows;
  const int threads = thread_count(n_blocks, p.num_threads);
  // dK in fp32 and one partial per concurrently running row block, all zeroed
  // here (the partials are cleared again as they are added). Workspace-cached:
  // at long contexts they are (threads + 1) x key rows x Di x 4 bytes.
  const std::size_t key_floats = static_cast<std::size_t>(p.key_rows * idim);
  const std::size_t accumulator_bytes = (threads + 1) * key_floats * sizeof(float);
  const core::ScratchBuffer accumulators(accumulator_bytes);
  float* const dk = reinterpret_cast<float*>(accumulators.data());
  std::memset(dk, 0, accumulator_bytes);
  auto partial_of = [&](int slot) { return dk + (slot + 1) * key_floats; };
  std::vector<int64_t> lo(threads), hi(threads);

  struct Scratch {
    core::ScratchVector<std::uint8_t> ib, ih, ikbuf, cbuf, bdq, adq, adk, dqacc;
    std::vector<float> w, dw, g, coef, contrib;
    std::vector<int64_t> key_rows;
  };
  std::vector<Scratch> scratch(threads);
  for (auto& s : scratch) {
    s.dw.resize(iheads);
    s.ib.resize(ichunks * igroups * 1024 + 64);
    s.ih.resize(ihc * dgroups * 1024 + 64);
    s.ikbuf.resize(kBlock * idim * 2 + 64);
    s.cbuf.resize(4 * 1024 + 64);
    s.bdq.resize(dgroups * 1024 + 64);
    s.adq.resize(igroups * 1024 + 64);
    s.adk.resize(ihc * 2048 + 64);
    s.dqacc.resize(iheads * idim * 4 + 64);
    s.w.resize(iheads);
    s.g.resize(topk + kBlock);
    s.coef.resize(kBlock * iheads);
    s.contrib.resize(kBlock * idim);
    s.key_rows.resize(topk + kBlock);
  }

  auto run_block = [&](int64_t block, int slot, Scratch& s) {
    configure_tiles();
    float* part = partial_of(slot);
    int64_t key_lo = p.key_rows, key_hi = 0;
    auto* ib = align64<std::uint32_t>(s.ib);
    auto* ih = align64<std::uint32_t>(s.ih);
    auto* ikbuf = align64<std::uint16_t>(s.ikbuf);
    auto* cbuf = align64<float>(s.cbuf);
    auto* bdq = align64<std::uint32_t>(s.bdq);
    auto* adq = align64<std::uint16_t>(s.adq);
    auto* adk = align64<std::uint16_t>(s.adk);
    auto* dqacc = align64<float>(s.dqacc);
    const int64_t end = std::min<int64_t>(rows.size(), (block + 1) * kBwdRows);
    for (int64_t r = block * kBwdRows; r < end; ++r) {
      const auto& seq = p.plan.seqs[rows[r].seq];
      const int64_t i = rows[r].i, row = seq.q_begin + i;
      const int64_t n = gradient_entries(p, seq, i, s.g.data(), s.key_rows.data());
      if (n == 0) continue;
      for (int64_t e = n; e < n + kBlock; ++e) s.g[e] = 0.0f;
      const auto* iq = reinterpret_cast<const std::uint16_t*>(p.index_query.bytes(row, 0));
      pack_heads_vnni(iq, p.index_query.head_stride, iheads, ichunks, 0, ib);
      pack_rows_vnni(iq, p.index_query.head_stride, ihc, idim, ih);
      for (int64_t j = 0; j < iheads; ++j) s.w[j] = p.weights.at(row, j, 0) * is;
      std::memset(dqacc, 0, iheads * idim * 4);
      float* dw = s.dw.data();
      std::fill(s.dw.begin(), s.dw.end(), 0.0f);
      for (int64_t c0 = 0; c0 < n; c0 += kBlock) {
        const int64_t m = std::min(kBlock, n - c0);
        const float* g = s.g.data() + c0;
        gather_rows(p.index_key, s.key_rows.data() + c0, m, idim, 0, ikbuf);
        if (c0 + kBlock < n) prefetch_rows(p.index_key, s.key_rows.data() + c0 + kBlock, std::min(kBlock, n - c0 - kBlock));
        // Dots, then dW and coef [32 entries][Hi] from each C pair.
        block_gemm(ikbuf, ichunks, ib, igroups, cbuf, [&](int64_t hg, const float* c) {
          const __m512 w = _mm512_loadu_ps(s.w.data() + hg * 16), zero = _mm512_setzero_ps();
          __m512 dwg = _mm512_loadu_ps(dw + hg * 16);
          for (int64_t e = 0; e < kBlock; ++e) {
            const __m512 d = _mm512_load_ps(c + e * 16);
            const __mmask16 pos = _mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ);
            const __m512 ge = _mm512_set1_ps(g[e]);
            dwg = _mm512_fmadd_ps(ge, _mm512_maskz_mov_ps(pos, d), dwg);
            _mm512_storeu_ps(s.coef.data() + e * iheads + hg * 16, _mm512_maskz_mul_ps(pos, ge, w));
          }
          _mm512_storeu_ps(dw + hg * 16, dwg);
        });
        // A of dQ: coef^T [16 heads][32 entries] bf16 per head group.
        for (int64_t hg = 0; hg < igroups; ++hg)
          for (int64_t eb = 0; eb < 2; ++eb) {
            __m512i t[16];
            for (int e = 0; e < 16; ++e)
              t[e] = _mm512_castps_si512(_mm512_loadu_ps(s.coef.data() + (eb * 16 + e) * iheads + hg * 16));
            transpose16x16(t);
            for (int h = 0; h < 16; ++h)
              _mm256_store_si256(reinterpret_cast<__m256i*>(adq + (hg * 16 + h) * 32 + eb * 16),
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(t[h])));
          }
        // A of dK: coef [32 entries][32 heads] bf16 per 32-head chunk.
        for (int64_t hc = 0; hc < ihc; ++hc)
          for (int64_t e = 0; e < kBlock; ++e) {
            const float* cf = s.coef.data() + e * iheads + hc * 32;
            _mm512_store_si512(adk + (hc * 32 + e) * 32,
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(cf + 16), _mm512_loadu_ps(cf)));
          }
        pack_rows_vnni(ikbuf, idim, 1, idim, bdq);
        // dQ accumulates through the fp32 row buffer.
        dq_update(dqacc, idim, adq, bdq, igroups, dgroups);
        // dK contributions [32 entries][Di], scattered in entry order.
        float* contrib = s.contrib.data();
        dk_contrib(contrib, idim, adk, ih, ihc, dgroups);
        for (int64_t e = 0; e < m; ++e) {
          const int64_t key = s.key_rows[c0 + e];
          key_lo = std::min(key_lo, key);
          key_hi = std::max(key_hi, key + 1);
          float* dst = part + key * idim;
          const float* src = contrib + e * idim;
          for (int64_t d = 0; d < idim; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_add_ps(_mm512_loadu_ps(dst + d), _mm512_loadu_ps(src + d)));
        }
      }
      auto* dq_out = static_cast<std::uint16_t*>(p.d_index_query) + row * iheads * idim;
      for (int64_t k = 0; k < iheads * idim; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dq_out + k),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(dqacc + k)));
      alignas(64) float dwl[16];
      for (int64_t hg = 0; hg < igroups; ++hg) {
        _mm512_store_ps(dwl, _mm512_mul_ps(_mm512_loadu_ps(dw + hg * 16), _mm512_set1_ps(is)));
        for (int64_t l = 0; l < 16; ++l)
          core::store_float(p.d_weights, wdt, row * iheads + hg * 16 + l, dwl[l]);
      }
    }
    lo[slot] = key_lo;
    hi[slot] = key_hi;
    release_tiles();
  };

  for (int64_t first = 0; first < n_blocks; first += threads) {
    const int64_t wave = std::min<int64_t>(threads, n_blocks - first);
    core::parallel_for(wave, static_cast<int>(wave), [&](int64_t k, int thread) {
      run_block(first + k, static_cast<int>(k), scratch[thread]);
    });
    // Add the wave's partials in block order and clear them; keys split across threads.
    int64_t wlo = p.key_rows, whi = 0;
    for (int64_t k = 0; k < wave; ++k) {
      wlo = std::min(wlo, lo[k]);
      whi = std::max(whi, hi[k]);
    }
    if (whi <= wlo) continue;
    const int64_t span = whi - wlo, per = 64;
    const int64_t pieces = (span + per - 1) / per;
    core::parallel_for(pieces, thread_count(pieces, threads), [&](int64_t piece, int) {
      const int64_t k0 = wlo + piece * per, k1 = std::min(whi, k0 + per);
      for (int64_t k = 0; k < wave; ++k) {
        const int64_t a = std::max(k0, lo[k]), b = std::min(k1, hi[k]);
        if (a >= b) continue;
        float* src = partial_of(static_cast<int>(k)) + a * idim;
        float* dst = dk + a * idim;
        for (int64_t x = 0; x < (b - a) * idim; ++x) {
          dst[x] += src[x];
          src[x] = 0.0f;
        }
      }
    });
  }
  auto* dk_out = static_cast<std::uint16_t*>(p.d_index_key);
  for (int64_t x = 0; x < p.key_rows * idim; ++x) core::store_float(dk_out, DType::bf16, x, dk[x]);
}

}  // namespace

const SparseKlKernels& DSA_KL_SPARSE_KERNELS() {
  static const SparseKlKernels kernels{DSA_KL_LABEL, sparse_fwd, sparse_bwd};
  return kernels;
}

}  // namespace dsa::cpu::kl_kernels
