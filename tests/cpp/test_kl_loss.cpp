// KL losses (docs/ops.md 4.3, 4.4): the fused CPU backend against the
// reference on small problems, on every ISA path, and bit-identical for
// 1 and 2 threads; bad inputs are rejected before anything is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/numeric.h"
#include "dsa/dsa.h"
#include "isa_paths.h"

namespace {

using namespace dsa;

struct Buffer {
  std::vector<std::uint16_t> half;
  std::vector<float> f32;
  DType dtype;
  std::vector<std::int64_t> shape;
  TensorView view() {
    return make_view(dtype == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(half.data()), dtype,
                     shape);
  }
  float at(std::int64_t i) const {
    return dtype == DType::f32 ? f32[i] : core::load_float(half.data(), dtype, i);
  }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
};

Buffer random_buffer(std::vector<std::int64_t> shape, DType dtype, std::mt19937& rng, float lo = -1, float hi = 1) {
  Buffer b{{}, {}, dtype, shape};
  std::uniform_real_distribution<float> dist(lo, hi);
  const std::int64_t n = b.numel();
  if (dtype == DType::f32) {
    b.f32.resize(n);
    for (auto& v : b.f32) v = dist(rng);
  } else {
    b.half.resize(n);
    for (std::int64_t i = 0; i < n; ++i) core::store_float(b.half.data(), dtype, i, dist(rng));
  }
  return b;
}

Buffer zeros(std::vector<std::int64_t> shape, DType dtype) {
  Buffer b{{}, {}, dtype, shape};
  if (dtype == DType::f32) b.f32.assign(b.numel(), 0.0f); else b.half.assign(b.numel(), 0);
  return b;
}

// A small sparse problem: two sequences (one with prefix KV), random indices
// including -1, invisible and duplicate entries; attention stats from an
// exact softmax over the selection (so the teacher is a proper distribution).
struct SparseCase {
  DType dtype;
  std::int64_t T = 13, S = 21, H = 3, D = 24, Hi = 5, Di = 20, K = 9, ratio = 1;
  CuSeqlens cu_q{0, 5, 13}, cu_k{0, 9, 21};
  Buffer q, kv, iq, ik, w, mx, sm;
  std::vector<std::int32_t> idx;
  std::vector<float> sinks;

  // Head counts and dims of a wide case: {H, D, Hi, Di}.
  struct Heads {
    std::int64_t h, d, hi, di;
  };
  SparseCase(DType dt, std::uint32_t seed, std::int64_t cmp_ratio = 1, bool wide = false,
             Heads heads = {16, 64, 32, 32})
      : dtype(dt), ratio(cmp_ratio) {
    if (wide) {
      // Shapes the pair kernels take (heads multiples of 16 / 32, dims of 32),
      // more entries than one 32-entry block and more rows than one dK row block.
      T = 70, S = 90, H = heads.h, D = heads.d, Hi = heads.hi, Di = heads.di, K = 45;
      cu_q = {0, 30, 70};
      cu_k = {0, 40, 90};
    }
    std::mt19937 rng(seed);
    const std::int64_t rows = ratio > 1 ? (9 / ratio + 12 / ratio) : S;
    q = random_buffer({T, H, D}, dtype, rng);
    kv = random_buffer({rows, D}, dtype, rng);
    iq = random_buffer({T, Hi, Di}, dtype, rng);
    ik = random_buffer({rows, Di}, dtype, rng);
    w = random_buffer({T, Hi}, dtype, rng, -0.5f, 1.0f);
    mx = zeros({T, H}, DType::f32);
    sm = zeros({T, H}, DType::f32);
    std::uniform_int_distribution<int> pick(-2, ratio > 1 ? 3 : (wide ? 50 : 12));
    idx.resize(T * K);
    for (auto& v : idx) v = pick(rng);
    // Into [-1, the sequence's key count): the ops refuse positions a sequence
    // does not hold; invisible (non-causal) entries and -1 stay.
    for (std::int64_t b = 0; b < 2; ++b) {
      const std::int64_t held = (cu_k[b + 1] - cu_k[b]) / ratio;
      for (std::int64_t r = cu_q[b] * K; r < cu_q[b + 1] * K; ++r)
        idx[r] = static_cast<std::int32_t>((idx[r] + 2) % (held + 1)) - 1;
    }
    idx[3] = idx[4];  // a duplicate
    for (std::int64_t k = 0; k < K; ++k) idx[2 * K + k] = -1;  // an empty row
    sinks.assign(H, 1.0f);
    sinks[0] = 0.5f, sinks[1] = -INFINITY, sinks[2] = 2.0f;
    if (wide) {
      for (std::int64_t h = 0; h < H; ++h) sinks[h] = 0.25f * static_cast<float>(h % 5) - 0.5f;
      sinks[3] = -INFINITY;
    }
    // Stats: softmax over all visible keys (a dense attention), which covers more than the selection.
    for (std::int64_t b = 0; b < 2; ++b) {
      const std::int64_t lq = cu_q[b + 1] - cu_q[b], lk = cu_k[b + 1] - cu_k[b];
      const std::int64_t c0 = ratio > 1 ? (b == 0 ? 0 : 9 / ratio) : cu_k[b];
      for (std::int64_t i = 0; i < lq; ++i) {
        const std::int64_t row = cu_q[b] + i, vis = visible_compressed(lk - lq + i, ratio);
        for (std::int64_t h = 0; h < H; ++h) {
          std::vector<double> l;
          for (std::int64_t s = 0; s < vis; ++s) {
            double dot = 0;
            for (std::int64_t d = 0; d < D; ++d) dot += double(q.at((row * H + h) * D + d)) * kv.at((c0 + s) * D + d);
            l.push_back(0.3 * dot);
          }
          double m = -INFINITY, z = 0;
          for (double v : l) m = std::max(m, v);
          for (double v : l) z += std::exp(v - m);
          mx.f32[row * H + h] = static_cast<float>(m);
          sm.f32[row * H + h] = static_cast<float>(z);
        }
      }
    }
    if (wide) {
      // Heads whose forward statistics say empty contribute nothing to the teacher.
      mx.f32[9 * H + 4] = -INFINITY;
      sm.f32[9 * H + 4] = 0.0f;
      sm.f32[10 * H + 5] = 0.0f;
    }
  }

  KlLossParams params(int threads) const {
    KlLossParams p;
    p.scale = 0.3f;
    p.index_scale = 0.7f;
    p.cmp_ratio = ratio;
    p.loss_coefficient = 1.5f;
    p.cu_seqlens_q = cu_q;
    p.cu_seqlens_k = cu_k;
    p.num_threads = threads;
    return p;
  }
};

struct SparseResult {
  float loss;
  std::vector<float> score_grad;
  Buffer dq, dk, dw;
};

SparseResult run_sparse(SparseCase& c, Backend backend, int threads, bool with_sinks) {
  SparseResult r{0, std::vector<float>(c.T * c.K), zeros(c.iq.shape, c.dtype), zeros(c.ik.shape, c.dtype),
                 zeros(c.w.shape, c.dtype)};
  TensorView idx = make_view(c.idx.data(), DType::i32, {c.T, c.K});
  TensorView sinks = with_sinks ? make_view(c.sinks.data(), DType::f32, {c.H}) : TensorView{};
  const KlLossParams p = c.params(threads);
  kl_loss_fwd({c.q.view(), c.kv.view(), idx, c.mx.view(), c.sm.view(), c.iq.view(), c.ik.view(), c.w.view(), sinks,
              TensorView{}, TensorView{}}, p, make_view(&r.loss, DType::f32, {1}),
              make_view(r.score_grad.data(), DType::f32, {c.T, c.K}), backend);
  kl_loss_bwd({.indices = idx, .index_query = c.iq.view(), .index_key = c.ik.view(), .weights = c.w.view()},
              make_view(r.score_grad.data(), DType::f32, {c.T, c.K}), 0.8f, p, {r.dq.view(), r.dk.view(),
              r.dw.view()}, backend);
  return r;
}

void expect_close(const Buffer& a, const Buffer& b, double tol, const char* what) {
  double scale = 1e-6;
  for (std::int64_t i = 0; i < b.numel(); ++i) scale = std::max(scale, std::abs(double(b.at(i))));
  for (std::int64_t i = 0; i < a.numel(); ++i)
    ASSERT_NEAR(a.at(i), b.at(i), tol * scale) << what << " element " << i;
}

void expect_identical(const Buffer& a, const Buffer& b, const char* what) {
  for (std::int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.at(i), b.at(i)) << what << " element " << i;
}

class KlIsa : public ::testing::TestWithParam<core::Isa> {
 protected:
  void SetUp() override {
    if (const std::string why = dsa_testing::skip_reason(GetParam()); !why.empty()) GTEST_SKIP() << why;
    core::limit_isa_for_testing(GetParam());
  }
  void TearDown() override { core::limit_isa_for_testing(core::Isa::amx); }
};

TEST_P(KlIsa, SparseMatchesReference) {
  for (std::int64_t ratio : {1, 4}) {
    for (bool with_sinks : {false, true}) {
      SparseCase c(DType::f32, 7 + ratio, ratio);
      const SparseResult ref = run_sparse(c, Backend::reference, 1, with_sinks);
      const SparseResult cpu = run_sparse(c, Backend::cpu, 2, with_sinks);
      EXPECT_GT(ref.loss, 0.0f);
      EXPECT_NEAR(cpu.loss, ref.loss, 1e-4 * std::abs(ref.loss) + 1e-6);
      for (std::size_t i = 0; i < ref.score_grad.size(); ++i) ASSERT_NEAR(cpu.score_grad[i], ref.score_grad[i], 1e-5);
      expect_close(cpu.dq, ref.dq, 1e-4, "d_index_query");
      expect_close(cpu.dk, ref.dk, 1e-4, "d_index_key");
      expect_close(cpu.dw, ref.dw, 1e-4, "d_weights");
    }
  }
}

TEST_P(KlIsa, SparseDeterministicAcrossThreads) {
  SparseCase c(DType::bf16, 11);
  const SparseResult one = run_sparse(c, Backend::cpu, 1, true);
  const SparseResult two = run_sparse(c, Backend::cpu, 2, true);
  EXPECT_EQ(one.loss, two.loss);
  EXPECT_EQ(one.score_grad, two.score_grad);
  expect_identical(one.dq, two.dq, "dq");
  expect_identical(one.dk, two.dk, "dk");
  expect_identical(one.dw, two.dw, "dw");
}

// bf16 shapes the pair kernels take (AMX tiles on AMX machines, vdpbf16ps on
// AVX-512-BF16 ones, the generic kernels elsewhere), per ISA level: against the
// reference, and bit-identical for 1, 2 and 3 threads (several dK row blocks,
// so several waves of partials). The shapes cover the products' remainders:
// odd 16-head groups (48, 80), 32-head chunks (96), dim groups that are not a
// multiple of the register block (Di 96: six groups of 16), and the V3.2
// teacher width 576.
const SparseCase::Heads kSparseShapes[] = {{16, 64, 32, 32}, {48, 128, 64, 128}, {80, 576, 96, 96}};

TEST(KlLossTiles, SparseBf16MatchesReference) {
  for (core::Isa isa : dsa_testing::distinct_paths({core::Isa::avx512, core::Isa::avx512_bf16, core::Isa::amx}))
    for (const auto& shape : kSparseShapes)
      for (bool with_sinks : {false, true}) {
        const dsa_testing::IsaLimit limit(isa);
        SCOPED_TRACE(std::string(core::isa_name(isa)) + " H " + std::to_string(shape.h) + " D " +
                     std::to_string(shape.d) + " Hi " + std::to_string(shape.hi) + " Di " + std::to_string(shape.di));
        SparseCase c(DType::bf16, 21, 1, true, shape);
        const SparseResult ref = run_sparse(c, Backend::reference, 1, with_sinks);
        const SparseResult cpu = run_sparse(c, Backend::cpu, 2, with_sinks);
        EXPECT_GT(ref.loss, 0.0f);
        EXPECT_NEAR(cpu.loss, ref.loss, 2e-3 * std::abs(ref.loss) + 1e-6);
        float grad_scale = 1e-6f;
        for (float v : ref.score_grad) grad_scale = std::max(grad_scale, std::abs(v));
        for (std::size_t i = 0; i < ref.score_grad.size(); ++i)
          ASSERT_NEAR(cpu.score_grad[i], ref.score_grad[i], 2e-3 * grad_scale) << i;
        // bf16 outputs and bf16 gradient coefficients in the tile products: a few bf16 ulps.
        expect_close(cpu.dq, ref.dq, 2e-2, "d_index_query");
        expect_close(cpu.dk, ref.dk, 2e-2, "d_index_key");
        expect_close(cpu.dw, ref.dw, 2e-2, "d_weights");
      }
}

TEST(KlLossTiles, SparseBf16DeterministicAcrossThreads) {
  for (core::Isa isa : dsa_testing::distinct_paths({core::Isa::avx512_bf16, core::Isa::amx}))
    for (const auto& shape : kSparseShapes) {
      const dsa_testing::IsaLimit limit(isa);
      SCOPED_TRACE(std::string(core::isa_name(isa)) + " H " + std::to_string(shape.h));
      SparseCase c(DType::bf16, 23, 1, true, shape);
      const SparseResult one = run_sparse(c, Backend::cpu, 1, true);
      for (int threads : {2, 3}) {
        const SparseResult other = run_sparse(c, Backend::cpu, threads, true);
        EXPECT_EQ(one.loss, other.loss);
        EXPECT_EQ(one.score_grad, other.score_grad);
        expect_identical(one.dq, other.dq, "dq");
        expect_identical(one.dk, other.dk, "dk");
        expect_identical(one.dw, other.dw, "dw");
      }
    }
}

// Dense warm-up: MHA or MQA main attention with rope, prefix KV in the second sequence.
struct DenseCase {
  DType dtype;
  std::int64_t T = 14, S = 22, H = 4, Hk, D = 16, Dr = 8, Hi = 3, Di = 24;
  CuSeqlens cu_q{0, 6, 14}, cu_k{0, 6, 22};
  Buffer iq, ik, w, q, k, qr, kr, mx, sm, lse;

  // tiles: dims the pair kernels take (multiples of 32) and sequences spanning
  // several 32-query blocks and 32-key tiles, the last ones partial; dims are
  // {D, Dr, Hi, Di}.
  struct Dims {
    std::int64_t d, dr, hi, di;
  };
  DenseCase(DType dt, std::int64_t key_heads, std::uint32_t seed, bool tiles = false, Dims dims = {32, 32, 5, 64})
      : dtype(dt), Hk(key_heads) {
    if (tiles) {
      T = 90, S = 190, D = dims.d, Dr = dims.dr, Hi = dims.hi, Di = dims.di;
      cu_q = {0, 40, 90};
      cu_k = {0, 40, 190};
    }
    std::mt19937 rng(seed);
    iq = random_buffer({T, Hi, Di}, dtype, rng);
    ik = random_buffer({S, Di}, dtype, rng);
    w = random_buffer({T, Hi}, dtype, rng, -0.5f, 1.0f);
    q = random_buffer({T, H, D}, dtype, rng);
    k = random_buffer({S, Hk, D}, dtype, rng);
    qr = random_buffer({T, H, Dr}, dtype, rng);
    kr = random_buffer({S, Hk, Dr}, dtype, rng);
    mx = zeros({T, H}, DType::f32);
    sm = zeros({T, H}, DType::f32);
    lse = zeros({T}, DType::f32);
    for (std::int64_t b = 0; b < 2; ++b) {
      const std::int64_t lq = cu_q[b + 1] - cu_q[b], lk = cu_k[b + 1] - cu_k[b];
      for (std::int64_t i = 0; i < lq; ++i) {
        const std::int64_t row = cu_q[b] + i;
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t kh = h / (H / Hk);
          std::vector<double> l;
          for (std::int64_t s = 0; s <= lk - lq + i; ++s) {
            const std::int64_t key = cu_k[b] + s;
            double dot = 0;
            for (std::int64_t d = 0; d < D; ++d) dot += double(q.at((row * H + h) * D + d)) * k.at((key * Hk + kh) * D + d);
            for (std::int64_t d = 0; d < Dr; ++d) dot += double(qr.at((row * H + h) * Dr + d)) * kr.at((key * Hk + kh) * Dr + d);
            l.push_back(0.25 * dot);
          }
          double m = -INFINITY, z = 0;
          for (double v : l) m = std::max(m, v);
          for (double v : l) z += std::exp(v - m);
          mx.f32[row * H + h] = static_cast<float>(m);
          sm.f32[row * H + h] = static_cast<float>(z);
        }
      }
    }
  }
  DenseIndexerKlParams params(int threads, Reduction reduction = Reduction::mean) const {
    DenseIndexerKlParams p;
    p.scale = 0.25f;
    p.index_scale = 0.6f;
    p.loss_coefficient = 2.0f;
    p.reduction = reduction;
    p.cu_seqlens_q = cu_q;
    p.cu_seqlens_k = cu_k;
    p.num_threads = threads;
    return p;
  }
};

struct DenseResult {
  float loss;
  Buffer lse, dq, dk, dw;
};

DenseResult run_dense(DenseCase& c, Backend backend, int threads, Reduction reduction) {
  DenseResult r{0, zeros({c.T}, DType::f32), zeros(c.iq.shape, c.dtype), zeros(c.ik.shape, c.dtype), zeros(c.w.shape, c.dtype)};
  DenseIndexerLseParams lp;
  lp.scale = 0.6f;
  lp.cu_seqlens_q = c.cu_q;
  lp.cu_seqlens_k = c.cu_k;
  lp.num_threads = threads;
  dense_indexer_lse(c.iq.view(), c.ik.view(), c.w.view(), lp, r.lse.view(), backend);
  // Both backends consume the reference lse so the KL comparison isolates the KL kernels.
  dense_indexer_lse(c.iq.view(), c.ik.view(), c.w.view(), lp, c.lse.view(), Backend::reference);
  const auto p = c.params(threads, reduction);
  dense_indexer_kl_loss_fwd({c.iq.view(), c.ik.view(), c.w.view(), c.q.view(), c.k.view(), c.mx.view(), c.sm.view(),
                            c.lse.view(), c.qr.view(), c.kr.view()}, p, make_view(&r.loss, DType::f32, {1}), backend);
  dense_indexer_kl_loss_bwd({c.iq.view(), c.ik.view(), c.w.view(), c.q.view(), c.k.view(), c.mx.view(), c.sm.view(),
                            c.lse.view(), c.qr.view(), c.kr.view()}, 1.3f, p, {r.dq.view(), r.dk.view(), r.dw.view()},
                            backend);
  return r;
}

TEST_P(KlIsa, DenseMatchesReference) {
  for (std::int64_t hk : {4, 1}) {
    for (Reduction red : {Reduction::mean, Reduction::sum}) {
      DenseCase c(DType::f32, hk, 3 + hk);
      const DenseResult ref = run_dense(c, Backend::reference, 1, red);
      const DenseResult cpu = run_dense(c, Backend::cpu, 2, red);
      expect_close(cpu.lse, ref.lse, 1e-5, "indexer_lse");
      EXPECT_GT(ref.loss, 0.0f);
      EXPECT_NEAR(cpu.loss, ref.loss, 1e-4 * std::abs(ref.loss) + 1e-6);
      expect_close(cpu.dq, ref.dq, 1e-4, "d_index_query");
      expect_close(cpu.dk, ref.dk, 1e-4, "d_index_key");
      expect_close(cpu.dw, ref.dw, 1e-4, "d_head_weights");
    }
  }
}

TEST_P(KlIsa, DenseDeterministicAcrossThreads) {
  DenseCase c(DType::bf16, 1, 5);
  const DenseResult one = run_dense(c, Backend::cpu, 1, Reduction::mean);
  const DenseResult two = run_dense(c, Backend::cpu, 2, Reduction::mean);
  EXPECT_EQ(one.loss, two.loss);
  expect_identical(one.lse, two.lse, "lse");
  expect_identical(one.dq, two.dq, "dq");
  expect_identical(one.dk, two.dk, "dk");
  expect_identical(one.dw, two.dw, "dw");
}

// bf16 shapes the dense pair kernels take (AMX tiles on AMX machines,
// vdpbf16ps on AVX-512-BF16 ones, the generic kernels elsewhere), per ISA
// level: against the reference, MHA and MQA, and bit-identical for 1, 2 and 3
// threads. The dims cover a teacher split over two tensors of different widths
// (D 128 + Dr 64) and indexer dims of two and six 16-wide groups.
const DenseCase::Dims kDenseShapes[] = {{32, 32, 5, 64}, {128, 64, 3, 96}, {64, 32, 2, 32}};

TEST(KlLossTiles, DenseBf16MatchesReference) {
  for (core::Isa isa : dsa_testing::distinct_paths({core::Isa::avx512, core::Isa::avx512_bf16, core::Isa::amx}))
    for (const auto& dims : kDenseShapes)
      for (std::int64_t hk : {4, 1}) {
        const dsa_testing::IsaLimit limit(isa);
        SCOPED_TRACE(std::string(core::isa_name(isa)) + " D " + std::to_string(dims.d) + " Dr " +
                     std::to_string(dims.dr) + " Hi " + std::to_string(dims.hi) + " Di " + std::to_string(dims.di) +
                     " Hk " + std::to_string(hk));
        DenseCase c(DType::bf16, hk, 31 + hk, true, dims);
        const DenseResult ref = run_dense(c, Backend::reference, 1, Reduction::mean);
        const DenseResult cpu = run_dense(c, Backend::cpu, 2, Reduction::mean);
        EXPECT_GT(ref.loss, 0.0f);
        EXPECT_NEAR(cpu.loss, ref.loss, 2e-3 * std::abs(ref.loss) + 1e-6);
        expect_close(cpu.lse, ref.lse, 1e-3, "indexer_lse");
        // bf16 outputs and bf16 gradient coefficients in the tile products: a few bf16 ulps.
        expect_close(cpu.dq, ref.dq, 2e-2, "d_index_query");
        expect_close(cpu.dk, ref.dk, 2e-2, "d_index_key");
        expect_close(cpu.dw, ref.dw, 2e-2, "d_head_weights");
      }
}

TEST(KlLossTiles, DenseBf16DeterministicAcrossThreads) {
  for (core::Isa isa : dsa_testing::distinct_paths({core::Isa::avx512_bf16, core::Isa::amx}))
    for (const auto& dims : kDenseShapes) {
      const dsa_testing::IsaLimit limit(isa);
      SCOPED_TRACE(std::string(core::isa_name(isa)) + " Di " + std::to_string(dims.di));
      DenseCase c(DType::bf16, 4, 37, true, dims);
      const DenseResult one = run_dense(c, Backend::cpu, 1, Reduction::mean);
      for (int threads : {2, 3}) {
        const DenseResult other = run_dense(c, Backend::cpu, threads, Reduction::mean);
        EXPECT_EQ(one.loss, other.loss);
        expect_identical(one.lse, other.lse, "lse");
        expect_identical(one.dq, other.dq, "dq");
        expect_identical(one.dk, other.dk, "dk");
        expect_identical(one.dw, other.dw, "dw");
      }
    }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, KlIsa,
                         ::testing::Values(core::Isa::portable, core::Isa::avx2, core::Isa::avx512, core::Isa::avx512_bf16,
                                           core::Isa::amx),
                         [](const auto& info) { return std::string(core::isa_name(info.param)); });

// NaN in an indexer input (index query, index key or weights) makes the KL
// losses NaN on both backends, as in the float64 oracle: it reaches a counted
// row's student softmax (the ReLU keeps NaN, a NaN lse row is counted). The
// fused dense lse has NaN where the reference's has, and the fused gradients
// are NaN wherever the reference's are; they may be in a few more places,
// where a closed ReLU gate or a masked key's 0 meets a NaN input in a product
// (docs/hardening.md, "Non-finite data").
void set_nan(Buffer& b, std::int64_t i) {
  if (b.dtype == DType::f32) b.f32[i] = NAN; else core::store_float(b.half.data(), b.dtype, i, NAN);
}

// (A gradient may have no NaN at all: with NaN in every index key, each dot is
// NaN and the closed ReLU gate passes nothing to d_index_key.)
void expect_nans_cover(const Buffer& fused, const Buffer& ref, const char* what) {
  for (std::int64_t i = 0; i < ref.numel(); ++i)
    if (std::isnan(ref.at(i))) ASSERT_TRUE(std::isnan(fused.at(i))) << what << " element " << i << ": " << fused.at(i);
}

TEST(KlLoss, NanInAnIndexerInputReachesTheLoss) {
  for (core::Isa isa : dsa_testing::distinct_paths())
    for (DType dt : {DType::f32, DType::bf16})
      for (const char* where : {"index_query", "index_key", "weights"}) {
        const dsa_testing::IsaLimit limit(isa);
        SCOPED_TRACE(std::string(core::isa_name(isa)) + " " + dtype_name(dt) + ", NaN in " + where);
        const bool tiles = dt == DType::bf16;  // the pair kernels' shapes
        const auto nan_into = [&](Buffer& iq, Buffer& ik, Buffer& w, bool one_row) {
          // Every query row (or key row) gets one, so every counted row sees NaN
          // whatever its random selection; the dense case also takes a single one.
          Buffer& b = where[6] == 'q' ? iq : where[6] == 'k' ? ik : w;
          const std::int64_t per_row = b.numel() / b.shape[0];
          if (one_row) set_nan(b, (b.shape[0] / 2) * per_row + 1);
          else
            for (std::int64_t r = 0; r < b.shape[0]; ++r) set_nan(b, r * per_row + r % per_row);
        };
        {
          SparseCase c(dt, 5, 1, tiles);
          nan_into(c.iq, c.ik, c.w, false);
          const SparseResult ref = run_sparse(c, Backend::reference, 1, true);
          const SparseResult cpu = run_sparse(c, Backend::cpu, 2, true);
          EXPECT_TRUE(std::isnan(ref.loss)) << "sparse, reference: " << ref.loss;
          EXPECT_TRUE(std::isnan(cpu.loss)) << "sparse, cpu: " << cpu.loss;
          expect_nans_cover(cpu.dq, ref.dq, "sparse d_index_query");
          expect_nans_cover(cpu.dk, ref.dk, "sparse d_index_key");
          expect_nans_cover(cpu.dw, ref.dw, "sparse d_weights");
        }
        for (bool one_row : {false, true}) {
          DenseCase c(dt, 1, 5, tiles);
          nan_into(c.iq, c.ik, c.w, one_row);
          const DenseResult ref = run_dense(c, Backend::reference, 1, Reduction::mean);
          const DenseResult cpu = run_dense(c, Backend::cpu, 2, Reduction::mean);
          EXPECT_TRUE(std::isnan(ref.loss)) << "dense, reference: " << ref.loss;
          EXPECT_TRUE(std::isnan(cpu.loss)) << "dense, cpu: " << cpu.loss;
          for (std::int64_t t = 0; t < c.T; ++t)
            ASSERT_EQ(std::isnan(cpu.lse.at(t)), std::isnan(ref.lse.at(t))) << "dense lse row " << t;
          expect_nans_cover(cpu.dq, ref.dq, "dense d_index_query");
          expect_nans_cover(cpu.dk, ref.dk, "dense d_index_key");
          expect_nans_cover(cpu.dw, ref.dw, "dense d_weights");
        }
      }
}

// An index outside its sequence's keys (here a packed row of the other
// sequence, and a compressed entry past the held ones) is refused by the
// forward and the backward on both backends, naming indices.
TEST(KlLoss, IndicesOutsideTheirSequenceAreRefused) {
  for (std::int64_t ratio : {1, 4})
    for (Backend backend : {Backend::cpu, Backend::reference})
      for (bool in_bwd : {false, true}) {
        SparseCase c(DType::f32, 5, ratio);
        const std::int64_t held = (c.cu_k[2] - c.cu_k[1]) / ratio;  // sequence 1's keys
        const std::int32_t bad = static_cast<std::int32_t>(held);
        std::int32_t& slot = c.idx[c.cu_q[1] * c.K + 2];
        if (!in_bwd) slot = bad;
        try {
          SparseResult r{0, std::vector<float>(c.T * c.K), zeros(c.iq.shape, c.dtype), zeros(c.ik.shape, c.dtype),
                         zeros(c.w.shape, c.dtype)};
          TensorView idx = make_view(c.idx.data(), DType::i32, {c.T, c.K});
          const KlLossParams p = c.params(2);
          kl_loss_fwd({c.q.view(), c.kv.view(), idx, c.mx.view(), c.sm.view(), c.iq.view(), c.ik.view(), c.w.view(),
                      TensorView{}, TensorView{}, TensorView{}}, p, make_view(&r.loss, DType::f32, {1}),
                      make_view(r.score_grad.data(), DType::f32, {c.T, c.K}), backend);
          slot = bad;
          kl_loss_bwd({.indices = idx, .index_query = c.iq.view(), .index_key = c.ik.view(), .weights = c.w.view()},
                      make_view(r.score_grad.data(), DType::f32, {c.T, c.K}), 0.8f, p, {r.dq.view(), r.dk.view(),
                      r.dw.view()}, backend);
          ADD_FAILURE() << "no error, ratio " << ratio << (in_bwd ? " (backward)" : " (forward)");
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
          EXPECT_EQ(std::string(e.what()).rfind("indices:", 0), 0u) << e.what();
          EXPECT_NE(std::string(e.what()).find("is " + std::to_string(bad) + ", outside"), std::string::npos) << e.what();
        }
      }
}

TEST(KlLoss, BadInputsRejectedWithoutWriting) {
  SparseCase c(DType::f32, 3);
  float loss = 123.0f;
  TensorView idx = make_view(c.idx.data(), DType::i32, {c.T, c.K});
  auto call = [&](const TensorView& q, const TensorView& kv, const TensorView& i, KlLossParams p) {
    kl_loss_fwd({q, kv, i, c.mx.view(), c.sm.view(), c.iq.view(), c.ik.view(), c.w.view(), TensorView{}, TensorView{},
                TensorView{}}, p, make_view(&loss, DType::f32, {1}), TensorView{}, Backend::cpu);
  };
  auto expect_invalid = [&](auto&& fn, const char* name) {
    try {
      fn();
      FAIL() << "no error for " << name;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  TensorView short_kv = c.kv.view();
  short_kv.shape[0] = 20;
  expect_invalid([&] { call(c.q.view(), short_kv, idx, c.params(1)); }, "kv");
  TensorView wrong_idx = make_view(c.idx.data(), DType::i32, {c.T - 1, c.K});
  expect_invalid([&] { call(c.q.view(), c.kv.view(), wrong_idx, c.params(1)); }, "indices");
  KlLossParams bad = c.params(1);
  bad.cu_seqlens_q = {0, 5, 12};
  expect_invalid([&] { call(c.q.view(), c.kv.view(), idx, bad); }, "query_lengths");
  bad = c.params(1);
  bad.cmp_ratio = 0;
  expect_invalid([&] { call(c.q.view(), c.kv.view(), idx, bad); }, "cmp_ratio");
  TensorView q_bf16 = c.q.view();
  q_bf16.dtype = DType::bf16;
  expect_invalid([&] { call(q_bf16, c.kv.view(), idx, c.params(1)); }, "kv");
  EXPECT_EQ(loss, 123.0f);
  EXPECT_THROW(parse_reduction("avg"), Error);
}

// Found by fuzz_kl_loss (corpus: regression-zero-head-dim-*): D = 0 (every
// logit 0) is legal, and the fused forward's per-thread buffers were then
// empty vectors whose null data() went to memset, undefined even for 0 bytes
// (the fuzz build's UBSan aborts on it). The backends must agree on it.
TEST(KlLoss, ZeroHeadDimMatchesReference) {
  const std::int64_t T = 3, Di = 2, K = 2;
  float q = 0, kv = 0;
  std::vector<float> iq{0.5f, 0.1f, 0.2f, 0.7f, 0.3f, 0.3f}, ik{0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
  std::vector<float> w(T, 1.0f), mx(T, 0.0f), sm(T, 2.0f);
  std::vector<std::int32_t> idx{0, -1, 0, 1, 1, 2};
  float loss[2] = {-1.0f, -1.0f};
  std::vector<float> score_grad(2 * T * K, -1.0f);
  const Backend backends[2] = {Backend::reference, Backend::cpu};
  for (int b = 0; b < 2; ++b)
    kl_loss_fwd({make_view(&q, DType::f32, {T, 1, 0}), make_view(&kv, DType::f32, {T, 0}),
                make_view(idx.data(), DType::i32, {T, K}), make_view(mx.data(), DType::f32, {T, 1}),
                make_view(sm.data(), DType::f32, {T, 1}), make_view(iq.data(), DType::f32, {T, 1, Di}),
                make_view(ik.data(), DType::f32, {T, Di}), make_view(w.data(), DType::f32, {T, 1}), TensorView{},
                TensorView{}, TensorView{}}, KlLossParams{}, make_view(&loss[b], DType::f32, {1}),
                make_view(score_grad.data() + b * T * K, DType::f32, {T, K}), backends[b]);
  EXPECT_GT(loss[0], 0.0f);  // the uniform teacher differs from the indexer's softmax
  EXPECT_NEAR(loss[1], loss[0], 1e-6f);
  for (std::int64_t i = 0; i < T * K; ++i) EXPECT_NEAR(score_grad[T * K + i], score_grad[i], 1e-6f) << i;
}

// Found by fuzz_kl_loss and fuzz_dense_indexer (corpus:
// regression-empty-query-huge-dims-*): with no query rows, a query may claim
// any head count or dim ([0, 2^40, 1] addresses nothing), and the fused
// kernels sized their per-thread buffers from them (std::bad_alloc). The loss
// of no rows is 0.
TEST(KlLoss, NoQueryRowsWithHugeHeadsOrDims) {
  const std::int64_t huge = std::int64_t{1} << 40;
  float f = 0;
  std::int32_t idx = 0;
  auto empty = [&](void* data, DType dtype, std::initializer_list<std::int64_t> shape, int huge_dim) {
    TensorView v = make_view(data, dtype, shape);
    v.shape[huge_dim] = huge;
    for (int d = v.ndim - 2; d >= 0; --d) v.strides[d] = v.strides[d + 1] * v.shape[d + 1];
    return v;
  };
  const TensorView none = make_view(&f, DType::f32, {0, 1}), iq = make_view(&f, DType::f32, {0, 1, 1});
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    float loss = -1.0f;
    kl_loss_fwd({empty(&f, DType::f32, {0, 1, 1}, 1), none, make_view(&idx, DType::i32, {0, 1}),
                empty(&f, DType::f32, {0, 1}, 1), empty(&f, DType::f32, {0, 1}, 1), iq, none, none, TensorView{},
                TensorView{}, TensorView{}}, KlLossParams{}, make_view(&loss, DType::f32, {1}), TensorView{},
                backend);
    EXPECT_EQ(loss, 0.0f) << backend_name(backend);
    loss = -1.0f;
    dense_indexer_kl_loss_fwd({iq, none, none, empty(&f, DType::f32, {0, 3, 1}, 2), empty(&f, DType::f32, {0, 1}, 1),
                              make_view(&f, DType::f32, {0, 3}), make_view(&f, DType::f32, {0, 3}),
                              make_view(&f, DType::f32, {0}), TensorView{}, TensorView{}}, DenseIndexerKlParams{},
                              make_view(&loss, DType::f32, {1}), backend);
    EXPECT_EQ(loss, 0.0f) << backend_name(backend);
    // The backward with Di = 2^40 (its per-thread dq buffers).
    const TensorView wide_iq = empty(&f, DType::f32, {0, 1, 1}, 2), wide_ik = empty(&f, DType::f32, {0, 1}, 1);
    dense_indexer_kl_loss_bwd({wide_iq, wide_ik, none, iq, none, make_view(&f, DType::f32, {0, 1}),
                              make_view(&f, DType::f32, {0, 1}), make_view(&f, DType::f32, {0}), TensorView{},
                              TensorView{}}, 1.0f, DenseIndexerKlParams{}, {wide_iq, wide_ik, none}, backend);
  }
}

// Found by fuzz_kl_loss (corpus: regression-empty-query-huge-index-heads-*): the
// sparse backward's dK pass has tasks whenever there are key rows, and sized
// per-row buffers from the index head count, which with no query rows nothing
// bounds. dK of no rows is 0, on every ISA path.
TEST(KlLoss, SparseBackwardWithoutQueryRowsAndHugeIndexHeads) {
  const std::int64_t huge = std::int64_t{1} << 40, S = 40, Di = 3;
  float f = 0;
  std::int32_t idx = 0;
  auto no_rows = [&](std::initializer_list<std::int64_t> shape) {  // [0, 2^40, ...]: addresses nothing
    TensorView v = make_view(&f, DType::f32, shape);
    v.shape[1] = huge;
    for (int d = v.ndim - 2; d >= 0; --d) v.strides[d] = v.strides[d + 1] * v.shape[d + 1];
    return v;
  };
  std::vector<float> index_key(S * Di, 0.5f);
  for (core::Isa isa : dsa_testing::distinct_paths()) {
    const dsa_testing::IsaLimit limit(isa);
    std::vector<float> d_index_key(S * Di, 7.0f);
    KlLossParams params;
    params.cu_seqlens_q = {0, 0};
    params.cu_seqlens_k = {0, S};
    EXPECT_NO_THROW(kl_loss_bwd({.indices = make_view(&idx, DType::i32, {0, 4}), .index_query = no_rows({0, 1, Di}),
                                .index_key = make_view(index_key.data(), DType::f32, {S, Di}),
                                .weights = no_rows({0, 1})}, make_view(&f, DType::f32, {0, 4}), 1.0f, params,
                                {no_rows({0, 1, Di}), make_view(d_index_key.data(), DType::f32, {S, Di}),
                                no_rows({0, 1})}, Backend::cpu))
        << core::isa_name(core::cpu_isa());
    for (float g : d_index_key) ASSERT_EQ(g, 0.0f) << core::isa_name(core::cpu_isa());
  }
}

// The same flaw's other side, not reached by the fuzzer yet: query rows but no key
// rows (2 raw keys at cmp_ratio 4 are no compressed entry), so nothing bounds the key
// dim D when H = 0 ([2, 0, 2^40] and [0, 2^40] address nothing); the fused forward
// sized its key tiles from it. No key is valid: loss 0.
TEST(KlLoss, SparseForwardWithoutKeyRowsAndHugeKeyDim) {
  const std::int64_t huge = std::int64_t{1} << 40, T = 2, K = 4, Hi = 1, Di = 3;
  float f = 0;
  std::vector<std::int32_t> idx(T * K, -1);  // nothing to point at: no key rows
  std::vector<float> iq(T * Hi * Di, 0.5f), w(T * Hi, 1.0f);
  TensorView query = make_view(&f, DType::f32, {T, 0, 1}), kv = make_view(&f, DType::f32, {0, 1});
  query.shape[2] = huge;
  kv.shape[1] = huge;
  for (core::Isa isa : dsa_testing::distinct_paths()) {
    const dsa_testing::IsaLimit limit(isa);
    float loss = -1.0f;
    KlLossParams params;
    params.cmp_ratio = 4;
    params.cu_seqlens_q = {0, T};
    params.cu_seqlens_k = {0, T};
    EXPECT_NO_THROW(kl_loss_fwd({query, kv, make_view(idx.data(), DType::i32, {T, K}),
                                make_view(&f, DType::f32, {T, 0}), make_view(&f, DType::f32, {T, 0}),
                                make_view(iq.data(), DType::f32, {T, Hi, Di}), make_view(&f, DType::f32, {0, Di}),
                                make_view(w.data(), DType::f32, {T, Hi}), TensorView{}, TensorView{}, TensorView{}},
                                params, make_view(&loss, DType::f32, {1}), TensorView{}, Backend::cpu))
        << core::isa_name(core::cpu_isa());
    EXPECT_EQ(loss, 0.0f) << core::isa_name(core::cpu_isa());
  }
}

// Found by fuzz_kl_loss (corpus: regression-rope-dim-overflow-*): with no rows,
// query [0, 1, 1] and query_rope [0, 1, INT64_MAX] are each valid, but the
// fused forward first sums D + Dr, which overflowed int64. Rejected now.
TEST(KlLoss, RopeDimWhoseSumWithDOverflowsIsRejected) {
  float f = 0, loss = 0;
  std::int32_t idx = 0;
  TensorView query_rope = make_view(&f, DType::f32, {0, 1, 1}), key_rope = make_view(&f, DType::f32, {0, 1});
  query_rope.shape[2] = key_rope.shape[1] = std::numeric_limits<std::int64_t>::max();
  const TensorView rows = make_view(&f, DType::f32, {0, 1}), heads = make_view(&f, DType::f32, {0, 1, 1});
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    try {
      kl_loss_fwd({heads, rows, make_view(&idx, DType::i32, {0, 1}), rows, rows, heads, rows, rows, TensorView{},
                  query_rope, key_rope}, KlLossParams{}, make_view(&loss, DType::f32, {1}), TensorView{}, backend);
      ADD_FAILURE() << "accepted D + Dr beyond int64";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("query_rope"), std::string::npos) << e.what();
    }
  }
}

// Found by fuzz_kl_loss and fuzz_dense_indexer (their corpus keeps the inputs
// as regression-negative-size-*): a hand-made index_key of -1 rows passed the
// validation, since -1 is how the length planner spells "no key tensor", and
// the reference backward then sized its accumulators from it
// (std::length_error, not a dsa::Error). Sizes are now checked on every view.
TEST(KlLoss, NegativeKeyRowsRejected) {
  float iq = 0, ik = 0, w = 0, sg = 0, d_iq = 0, d_ik = 0, d_w = 0, q = 0, k = 0, stat = 0, lse = 0;
  std::int32_t idx = 0;
  auto negative_rows = [](float* data) {
    TensorView v = make_view(data, DType::f32, {1, 1});
    v.shape[0] = -1;
    return v;
  };
  auto expect_invalid = [](auto&& call) {
    try {
      call();
      ADD_FAILURE() << "accepted an index_key of -1 rows";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("index_key"), std::string::npos) << e.what();
    }
  };
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    KlLossParams sparse;
    sparse.cmp_ratio = 4;  // index_key holds compressed entries: none for T = 0 queries
    expect_invalid([&] {
      kl_loss_bwd({.indices = make_view(&idx, DType::i32, {0, 1}),
                  .index_query = make_view(&iq, DType::f32, {0, 1, 1}), .index_key = negative_rows(&ik),
                  .weights = make_view(&w, DType::f32, {0, 1})}, make_view(&sg, DType::f32, {0, 1}), 1.0f, sparse,
                  {make_view(&d_iq, DType::f32, {0, 1, 1}), negative_rows(&d_ik),
                  make_view(&d_w, DType::f32, {0, 1})}, backend);
    });
    expect_invalid([&] {
      dense_indexer_kl_loss_bwd({make_view(&iq, DType::f32, {0, 1, 1}), negative_rows(&ik),
                                make_view(&w, DType::f32, {0, 1}), make_view(&q, DType::f32, {0, 1, 1}),
                                negative_rows(&k), make_view(&stat, DType::f32, {0, 1}),
                                make_view(&stat, DType::f32, {0, 1}), make_view(&lse, DType::f32, {0}), TensorView{},
                                TensorView{}}, 1.0f, DenseIndexerKlParams{}, {make_view(&d_iq, DType::f32, {0, 1, 1}),
                                negative_rows(&d_ik), make_view(&d_w, DType::f32, {0, 1})}, backend);
    });
  }
}

}  // namespace
