// Lightning indexer (docs/ops.md 4.1): fused CPU backend against the reference
// backend on every ISA path this machine has, thread-count determinism, bad
// inputs, and the sequence planner both backends share.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/cpu_features.h"
#include "core/numeric.h"
#include "core/sequences.h"
#include "dsa/error.h"
#include "dsa/indexer.h"
#include "isa_paths.h"

namespace {

using dsa::CuSeqlens;
using dsa::DType;
using dsa::Layout;
using dsa::TensorView;
using dsa::core::Isa;

const char* dtype_label(DType d) { return dsa::dtype_name(d); }

// A tensor stored in one of the float dtypes, filled from fp32 values rounded to it.
struct Buffer {
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<float> f32;
  std::vector<std::uint16_t> half;

  Buffer(DType d, std::vector<std::int64_t> s) : dtype(d), shape(std::move(s)) {
    std::int64_t n = 1;
    for (auto x : shape) n *= x;
    if (d == DType::f32) f32.assign(n, 0.0f); else half.assign(n, 0);
  }
  std::int64_t numel() const { return dtype == DType::f32 ? f32.size() : half.size(); }
  void set(std::int64_t i, float v) {
    if (dtype == DType::f32) f32[i] = v;
    else if (dtype == DType::bf16) half[i] = dsa::core::float_to_bf16(v);
    else half[i] = dsa::core::float_to_f16(v);
  }
  void* data() { return dtype == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(half.data()); }
  TensorView view() { return view_as(shape); }
  TensorView view_as(const std::vector<std::int64_t>& s) { return make_view(data(), dtype, s); }
};

template <class T>
TensorView view_of(std::vector<T>& data, DType dtype, const std::vector<std::int64_t>& s) {
  return make_view(data.data(), dtype, s);
}

CuSeqlens cumulative(const std::vector<std::int64_t>& lengths) {
  CuSeqlens cu{0};
  for (auto n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

enum class Fill { normal, small_integers };

// One indexer problem. Lengths are per-sequence (converted to cu_seqlens here);
// empty key lengths mean "not passed".
struct Case {
  std::string name;
  Layout layout = Layout::TND;
  std::vector<std::int64_t> q_lens, k_lens;  // TND: sequences; BSND: valid length per row
  std::int64_t sq = 0, sk = 0;               // BSND padded extents (rows per batch row)
  std::int64_t heads = 1, dim = 32, topk = 8, ratio = 1;
  float scale = 1.0f;
  bool key_with_head_dim = false;  // [S, 1, D] form
  bool f32_weights = false;        // weights fp32 even for half inputs
  bool nan_rows = false;           // NaN in some queries and one key
};

struct Problem {
  Buffer q, k, w;
  dsa::IndexerParams params;
  std::vector<std::int64_t> idx_shape;
  std::int64_t rows = 0;
  std::vector<std::int64_t> visible;  // per flattened row; -1 for padding rows
  std::int64_t key_rows = 0;
};

Problem make_problem(const Case& c, DType dtype, Fill fill, std::uint32_t seed) {
  const bool tnd = c.layout == Layout::TND;
  const std::int64_t batch = tnd ? 1 : static_cast<std::int64_t>(c.q_lens.size());
  std::int64_t q_extent = 0, raw_total = 0, cmp_total = 0;
  for (auto n : c.q_lens) q_extent += n;
  // Key lengths not passed: raw keys equal the queries when compressed (self-attention),
  // else the whole key tensor (BSND: every row full; TND cases then have one sequence).
  std::vector<std::int64_t> raw = c.k_lens;
  if (raw.empty()) raw = (c.layout == Layout::BSND && c.ratio == 1)
                             ? std::vector<std::int64_t>(c.q_lens.size(), c.sk) : c.q_lens;
  for (auto n : raw) {
    raw_total += n;
    cmp_total += c.ratio > 1 ? n / c.ratio : n;
  }
  std::int64_t key_extent = c.ratio > 1 ? cmp_total : raw_total;
  if (!tnd) {
    q_extent = c.sq;
    key_extent = c.sk;
  }
  const DType wtype = c.f32_weights ? DType::f32 : dtype;
  std::vector<std::int64_t> qs = tnd ? std::vector<std::int64_t>{q_extent, c.heads, c.dim}
                                     : std::vector<std::int64_t>{batch, q_extent, c.heads, c.dim};
  std::vector<std::int64_t> ks = tnd ? std::vector<std::int64_t>{key_extent, c.dim}
                                     : std::vector<std::int64_t>{batch, key_extent, c.dim};
  if (c.key_with_head_dim) ks.insert(ks.end() - 1, 1);
  std::vector<std::int64_t> ws = tnd ? std::vector<std::int64_t>{q_extent, c.heads}
                                     : std::vector<std::int64_t>{batch, q_extent, c.heads};
  Problem p{Buffer(dtype, qs), Buffer(dtype, ks), Buffer(wtype, ws), {}, {}, 0, {}, 0};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> small(-2, 2);
  auto value = [&] { return fill == Fill::normal ? normal(rng) : static_cast<float>(small(rng)); };
  for (std::int64_t i = 0; i < p.q.numel(); ++i) p.q.set(i, value());
  for (std::int64_t i = 0; i < p.k.numel(); ++i) p.k.set(i, value());
  for (std::int64_t i = 0; i < p.w.numel(); ++i) p.w.set(i, value());
  if (c.nan_rows) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const std::int64_t q_rows = p.q.numel() / (c.heads * c.dim);
    for (std::int64_t r = 1; r < q_rows; r += 7) p.q.set(r * c.heads * c.dim + (c.heads - 1) * c.dim, nan);
    const std::int64_t k_rows = p.k.numel() / c.dim;
    if (k_rows > 3) p.k.set(3 * c.dim + c.dim / 2, nan);  // key 3 (of the first sequence) is NaN for everyone
  }

  p.params.topk = c.topk;
  p.params.scale = c.scale;
  p.params.cmp_ratio = c.ratio;
  p.params.layout = c.layout;
  if (tnd) {
    p.params.cu_seqlens_q = cumulative(c.q_lens);
    if (!c.k_lens.empty()) p.params.cu_seqlens_k = cumulative(c.k_lens);
  } else {
    p.params.cu_seqlens_q = cumulative(c.q_lens);
    if (!c.k_lens.empty()) p.params.cu_seqlens_k = cumulative(c.k_lens);
  }
  p.idx_shape = tnd ? std::vector<std::int64_t>{q_extent, c.topk}
                    : std::vector<std::int64_t>{batch, q_extent, c.topk};
  p.rows = tnd ? q_extent : batch * q_extent;
  p.key_rows = key_extent;

  // Visible entries per row, straight from spec section 1 (not from the planner).
  p.visible.assign(p.rows, -1);
  std::int64_t q0 = 0;
  for (std::size_t b = 0; b < c.q_lens.size(); ++b) {
    const std::int64_t lq = c.q_lens[b], lk = raw[b];
    const std::int64_t base = tnd ? q0 : static_cast<std::int64_t>(b) * q_extent;
    for (std::int64_t i = 0; i < lq; ++i) {
      const std::int64_t pos = lk - lq + i;
      p.visible[base + i] = c.ratio > 1 ? (pos + 1) / c.ratio : pos + 1;
    }
    q0 += lq;
  }
  return p;
}

struct Result {
  std::vector<std::int32_t> indices;
  std::vector<float> scores;
};

Result run(Problem& p, dsa::Backend backend, int threads = 2, std::int64_t topk_override = 0) {
  dsa::IndexerParams params = p.params;
  std::vector<std::int64_t> shape = p.idx_shape;
  if (topk_override) {
    params.topk = topk_override;
    shape.back() = topk_override;
  }
  params.num_threads = threads;
  Result r;
  r.indices.assign(p.rows * params.topk, 12345);
  r.scores.assign(p.rows * params.topk, 7.0f);
  dsa::indexer_topk(p.q.view(), p.k.view(), p.w.view(), params, view_of(r.indices, DType::i32, shape),
                    view_of(r.scores, DType::f32, shape), backend);
  return r;
}

bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::memcmp(&a, &b, 4) == 0 || a == b;  // +0 == -0
}

// The output format of section 2 holds for every row: min(topk, visible) valid
// entries in strictly ascending visible positions, then -1 / -inf; padding rows empty.
void expect_well_formed(const Problem& p, const Result& r, std::int64_t topk, const std::string& where) {
  for (std::int64_t row = 0; row < p.rows; ++row) {
    const std::int64_t visible = std::max<std::int64_t>(p.visible[row], 0);
    const std::int64_t n = std::min(topk, visible);
    for (std::int64_t j = 0; j < topk; ++j) {
      const std::int32_t idx = r.indices[row * topk + j];
      const float s = r.scores[row * topk + j];
      if (j < n) {
        ASSERT_GE(idx, 0) << where << " row " << row << " slot " << j;
        ASSERT_LT(idx, visible) << where << " row " << row << " slot " << j;
        if (j > 0) ASSERT_GT(idx, r.indices[row * topk + j - 1]) << where << " row " << row;
      } else {
        ASSERT_EQ(idx, -1) << where << " row " << row << " slot " << j;
        ASSERT_TRUE(std::isinf(s) && s < 0) << where << " row " << row << " slot " << j << " score " << s;
      }
    }
  }
}

// Exact data: every score is exactly representable, so the fused result must equal
// the reference bit for bit, ties included.
void expect_identical(const Result& a, const Result& b, const std::string& where) {
  ASSERT_EQ(a.indices.size(), b.indices.size());
  for (std::size_t i = 0; i < a.indices.size(); ++i) {
    ASSERT_EQ(a.indices[i], b.indices[i]) << where << " at " << i;
    ASSERT_TRUE(same_float(a.scores[i], b.scores[i]))
        << where << " at " << i << ": " << a.scores[i] << " vs " << b.scores[i];
  }
}

// Rounded data: the docs/testing.md top-k rule against the reference's full scores.
void expect_close_selection(const Problem& p, const Result& fused, const Result& ref, const Result& full,
                            std::int64_t full_k, const std::string& where) {
  const std::int64_t topk = p.params.topk;
  double max_abs = 0.0;
  for (float s : full.scores)
    if (std::isfinite(s)) max_abs = std::max(max_abs, std::fabs(static_cast<double>(s)));
  const double tol = 1e-5 * max_abs + 1e-5;  // fp32 accumulation vs double, rounded once
  for (std::int64_t row = 0; row < p.rows; ++row) {
    const std::int64_t visible = std::max<std::int64_t>(p.visible[row], 0);
    const float* all = full.scores.data() + row * full_k;  // full[row][pos] for pos < visible
    std::vector<char> chosen(visible, 0);
    bool same = true;
    for (std::int64_t j = 0; j < std::min(topk, visible); ++j) {
      const std::int32_t idx = fused.indices[row * topk + j];
      chosen[idx] = 1;
      same = same && idx == ref.indices[row * topk + j];
      const float fs = fused.scores[row * topk + j];
      if (std::isnan(all[idx])) {
        EXPECT_TRUE(std::isnan(fs)) << where << " row " << row << " pos " << idx;
      } else {
        EXPECT_NEAR(fs, all[idx], tol) << where << " row " << row << " pos " << idx;
      }
    }
    if (same) continue;
    // Near-tie: every selected score >= every unselected visible score - tol (NaN lowest).
    double lowest_chosen = std::numeric_limits<double>::infinity(), best_other = -lowest_chosen;
    bool chosen_nan = false, other_number = false;
    for (std::int64_t s = 0; s < visible; ++s) {
      const float v = all[s];
      if (chosen[s]) {
        if (std::isnan(v)) chosen_nan = true; else lowest_chosen = std::min<double>(lowest_chosen, v);
      } else if (!std::isnan(v)) {
        other_number = true;
        best_other = std::max<double>(best_other, v);
      }
    }
    EXPECT_FALSE(chosen_nan && other_number) << where << " row " << row << ": NaN chosen over a number";
    EXPECT_GE(lowest_chosen, best_other - tol) << where << " row " << row << ": selection differs beyond a near-tie";
  }
}

using dsa_testing::IsaLimit;

std::vector<Case> cases() {
  std::vector<Case> out;
  {
    Case c;  // several sequences: length 0 and 1, prefix KV, tile edges, odd H and D
    c.name = "tnd_multi";
    c.q_lens = {5, 0, 1, 63, 65};
    c.k_lens = {5, 0, 1, 97, 65};
    c.heads = 3;
    c.dim = 65;
    c.topk = 7;
    c.scale = 0.5f;
    out.push_back(c);
  }
  {
    Case c;  // one sequence, lengths None, topk larger than most rows see
    c.name = "tnd_single_h1";
    c.q_lens = {97};
    c.heads = 1;
    c.dim = 32;
    c.topk = 64;
    out.push_back(c);
  }
  {
    Case c;  // topk beyond every visible count, wide heads, [S, 1, D] keys
    c.name = "tnd_topk_2048";
    c.q_lens = {1, 2, 70};
    c.k_lens = {1, 40, 130};
    c.heads = 16;
    c.dim = 128;
    c.topk = 2048;
    c.key_with_head_dim = true;
    out.push_back(c);
  }
  {
    Case c;  // padded rows, an empty row, prefix KV per row, fp32 weights for half inputs
    c.name = "bsnd_padded";
    c.layout = Layout::BSND;
    c.q_lens = {33, 0, 17};
    c.k_lens = {70, 5, 40};
    c.sq = 33;
    c.sk = 70;
    c.heads = 4;
    c.dim = 64;
    c.topk = 16;
    c.f32_weights = true;
    out.push_back(c);
  }
  {
    Case c;  // compressed keys, ratio 4, a sequence shorter than the ratio
    c.name = "tnd_ratio4";
    c.q_lens = {3, 40, 100};
    c.k_lens = {3, 60, 100};
    c.heads = 8;
    c.dim = 128;
    c.topk = 8;
    c.ratio = 4;
    out.push_back(c);
  }
  {
    Case c;  // ratio 128: most queries see nothing
    c.name = "tnd_ratio128";
    c.q_lens = {100, 300};
    c.heads = 3;
    c.dim = 32;
    c.topk = 4;
    c.ratio = 128;
    out.push_back(c);
  }
  {
    Case c;  // BSND compressed, key lengths None (= query lengths)
    c.name = "bsnd_ratio4";
    c.layout = Layout::BSND;
    c.q_lens = {40, 13};
    c.sq = 40;
    c.sk = 10;
    c.heads = 2;
    c.dim = 64;
    c.topk = 5;
    c.ratio = 4;
    c.key_with_head_dim = true;
    out.push_back(c);
  }
  {
    Case c;  // top-1, many heads, big dims
    c.name = "tnd_k1_h64_d576";
    c.q_lens = {65};
    c.heads = 64;
    c.dim = 576;
    c.topk = 1;
    out.push_back(c);
  }
  {
    Case c;  // three 16-head groups: a pair and a single in the bf16 pair kernels
    c.name = "tnd_h48_d64";
    c.q_lens = {40, 70};
    c.k_lens = {40, 130};
    c.heads = 48;
    c.dim = 64;
    c.topk = 16;
    out.push_back(c);
  }
  {
    Case c;  // 128 heads, many cuts of the running top-k
    c.name = "tnd_h128_k2";
    c.q_lens = {20, 50};
    c.k_lens = {200, 50};
    c.heads = 128;
    c.dim = 32;
    c.topk = 2;
    out.push_back(c);
  }
  {
    Case c;  // NaN scores: rows whose query has a NaN, and one NaN key
    c.name = "tnd_nan";
    c.q_lens = {10, 60};
    c.k_lens = {12, 90};
    c.heads = 3;
    c.dim = 64;
    c.topk = 9;
    c.nan_rows = true;
    out.push_back(c);
  }
  return out;
}

std::int64_t max_visible(const Problem& p) {
  std::int64_t m = 1;
  for (auto v : p.visible) m = std::max(m, v);
  return m;
}

TEST(Indexer, FusedMatchesReferenceOnEveryIsa) {
  const auto paths = dsa_testing::distinct_paths();
  ASSERT_FALSE(paths.empty());
  std::uint32_t seed = 1;
  for (const Case& c : cases()) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (Fill fill : {Fill::normal, Fill::small_integers}) {
        Problem p = make_problem(c, dtype, fill, seed++);
        const std::string base = c.name + "/" + dtype_label(dtype) + (fill == Fill::normal ? "/normal" : "/exact");
        const Result ref = run(p, dsa::Backend::reference, 1);
        expect_well_formed(p, ref, c.topk, base + "/reference");
        const std::int64_t full_k = max_visible(p);
        const Result full = fill == Fill::normal ? run(p, dsa::Backend::reference, 1, full_k) : Result{};
        for (Isa isa : paths) {
          IsaLimit limit(isa);
          ASSERT_EQ(dsa::core::cpu_isa(), isa);
          const std::string where = base + "/" + dsa::core::isa_name(isa);
          const Result fused = run(p, dsa::Backend::cpu, 2);
          expect_well_formed(p, fused, c.topk, where);
          if (fill == Fill::small_integers) expect_identical(fused, ref, where);
          else expect_close_selection(p, fused, ref, full, full_k, where);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// Hand-checked semantics: ties go to the smaller position, NaN ranks last.
TEST(Indexer, TiesAndNanOrderByHand) {
  // One query, 6 keys, Hi = 1, Di = 1: score = w * relu(q * k).
  float q[1] = {1.0f};
  float w[1] = {1.0f};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float k[6] = {2.0f, nan, 3.0f, 2.0f, -1.0f, 3.0f};  // scores 2, NaN, 3, 2, 0, 3
  for (auto backend : {dsa::Backend::reference, dsa::Backend::cpu}) {
    for (Isa isa : dsa_testing::distinct_paths()) {
      IsaLimit limit(isa);
      for (std::int64_t topk : {1, 2, 3, 4, 5, 6, 8}) {
        dsa::IndexerParams params;
        params.topk = topk;
        params.cu_seqlens_q = {0, 1};
        params.cu_seqlens_k = {0, 6};
        std::vector<std::int32_t> idx(topk, 99);
        std::vector<float> sc(topk, 99.0f);
        dsa::indexer_topk(dsa::make_view(q, DType::f32, {1, 1, 1}), dsa::make_view(k, DType::f32, {6, 1}),
                          dsa::make_view(w, DType::f32, {1, 1}), params,
                          dsa::make_view(idx.data(), DType::i32, {1, topk}),
                          dsa::make_view(sc.data(), DType::f32, {1, topk}), backend);
        // Rank order: 2 (3), 5 (3), 0 (2), 3 (2), 4 (0), 1 (NaN).
        std::vector<std::int32_t> rank = {2, 5, 0, 3, 4, 1};
        std::vector<std::int32_t> want(rank.begin(), rank.begin() + std::min<std::int64_t>(topk, 6));
        std::sort(want.begin(), want.end());
        want.resize(topk, -1);
        EXPECT_EQ(idx, want) << dsa::backend_name(backend) << " " << dsa::core::isa_name(isa) << " topk " << topk;
        if (topk >= 6) EXPECT_TRUE(std::isnan(sc[1]));
      }
    }
  }
}

TEST(Indexer, ThreadCountDoesNotChangeBits) {
  Case c;
  c.topk = 20;
  // Padded heads and dims; then heads in 16-row tiles with a wide dim (direct query loads),
  // on shorter sequences: at the first shape's lengths the wide one took ~40 s under ASan.
  struct Shape {
    std::int64_t heads, dim;
    std::vector<std::int64_t> q_lens, k_lens;
  };
  for (const Shape& shape : {Shape{5, 96, {3, 150, 1, 90}, {3, 200, 9, 90}}, Shape{48, 576, {3, 40, 1, 30}, {3, 60, 9, 30}}})
  for (Isa isa : dsa_testing::distinct_paths()) {
    IsaLimit limit(isa);
    c.heads = shape.heads;
    c.dim = shape.dim;
    c.q_lens = shape.q_lens;
    c.k_lens = shape.k_lens;
    for (DType dtype : {DType::f32, DType::bf16}) {
      Problem p = make_problem(c, dtype, Fill::normal, 77);
      const Result one = run(p, dsa::Backend::cpu, 1);
      for (int threads : {2, 3}) {
        const Result many = run(p, dsa::Backend::cpu, threads);
        EXPECT_EQ(one.indices, many.indices) << dsa::core::isa_name(isa) << " threads " << threads;
        EXPECT_EQ(0, std::memcmp(one.scores.data(), many.scores.data(), one.scores.size() * 4))
            << dsa::core::isa_name(isa) << " threads " << threads;
      }
    }
  }
}

TEST(Indexer, ScoresAreOptional) {
  Case c;
  c.q_lens = {40};
  c.heads = 2;
  c.dim = 32;
  c.topk = 6;
  Problem p = make_problem(c, DType::bf16, Fill::normal, 5);
  const Result with = run(p, dsa::Backend::cpu, 2);
  for (auto backend : {dsa::Backend::reference, dsa::Backend::cpu}) {
    std::vector<std::int32_t> idx(p.rows * c.topk, 0);
    dsa::IndexerParams params = p.params;
    dsa::indexer_topk(p.q.view(), p.k.view(), p.w.view(), params, view_of(idx, DType::i32, p.idx_shape),
                      TensorView{}, backend);
    if (backend == dsa::Backend::cpu) EXPECT_EQ(idx, with.indices);
    expect_well_formed(p, Result{idx, std::vector<float>(idx.size(), -std::numeric_limits<float>::infinity())},
                       c.topk, "no scores");
  }
}

// ---- bad inputs ----------------------------------------------------------

struct BadCall {
  std::string name;         // what is wrong
  std::string argument;     // the word the message must contain
  std::function<void(Problem&, dsa::IndexerParams&, std::vector<std::int64_t>& q_shape,
                     std::vector<std::int64_t>& k_shape, std::vector<std::int64_t>& w_shape,
                     std::vector<std::int64_t>& idx_shape, DType& idx_dtype, DType& scores_dtype,
                     DType& key_dtype)>
      mutate;
};

void expect_rejected(const Case& c, const BadCall& bad) {
  for (auto backend : {dsa::Backend::reference, dsa::Backend::cpu}) {
    Problem p = make_problem(c, DType::f32, Fill::normal, 3);
    dsa::IndexerParams params = p.params;
    std::vector<std::int64_t> q_shape = p.q.shape, k_shape = p.k.shape, w_shape = p.w.shape,
                              idx_shape = p.idx_shape;
    DType idx_dtype = DType::i32, scores_dtype = DType::f32, key_dtype = DType::f32;
    bad.mutate(p, params, q_shape, k_shape, w_shape, idx_shape, idx_dtype, scores_dtype, key_dtype);
    std::vector<std::int32_t> idx(4096, 12345);
    std::vector<float> sc(4096, 7.0f);
    std::vector<std::uint16_t> key_half(p.k.numel(), 0);
    TensorView q = p.q.view_as(q_shape), k = p.k.view_as(k_shape), w = p.w.view_as(w_shape);
    if (key_dtype != DType::f32) k = view_of(key_half, key_dtype, k_shape);
    TensorView iv = view_of(idx, idx_dtype, idx_shape), sv = view_of(sc, scores_dtype, idx_shape);
    try {
      dsa::indexer_topk(q, k, w, params, iv, sv, backend);
      ADD_FAILURE() << bad.name << ": accepted by " << dsa::backend_name(backend);
    } catch (const dsa::Error& e) {
      EXPECT_EQ(e.kind(), dsa::ErrorKind::invalid_argument) << bad.name << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(bad.argument), std::string::npos)
          << bad.name << ": message does not name '" << bad.argument << "': " << e.what();
    }
    EXPECT_TRUE(std::all_of(idx.begin(), idx.end(), [](std::int32_t v) { return v == 12345; }))
        << bad.name << ": indices written";
    EXPECT_TRUE(std::all_of(sc.begin(), sc.end(), [](float v) { return v == 7.0f; }))
        << bad.name << ": scores written";
  }
}

TEST(Indexer, BadInputsThrowNamingTheArgumentAndWriteNothing) {
  Case tnd;
  tnd.q_lens = {4, 6};
  tnd.k_lens = {5, 8};
  tnd.heads = 2;
  tnd.dim = 16;
  tnd.topk = 3;
  using P = Problem;
  using Prm = dsa::IndexerParams;
  using S = std::vector<std::int64_t>;
  std::vector<BadCall> bad = {
      {"query rank", "index_query", [](P&, Prm&, S& q, S&, S&, S&, DType&, DType&, DType&) { q = {10, 32}; }},
      {"key rank", "index_key", [](P&, Prm&, S&, S& k, S&, S&, DType&, DType&, DType&) { k = {13}; }},
      {"key heads != 1", "index_key", [](P&, Prm&, S&, S& k, S&, S&, DType&, DType&, DType&) { k = {1, 13, 16}; }},
      {"key dtype mismatch", "index_key", [](P&, Prm&, S&, S&, S&, S&, DType&, DType&, DType& kd) { kd = DType::bf16; }},
      {"Di mismatch", "index_key", [](P&, Prm&, S&, S& k, S&, S&, DType&, DType&, DType&) { k = {26, 8}; }},
      {"weights heads", "weights", [](P&, Prm&, S&, S&, S& w, S&, DType&, DType&, DType&) { w = {10, 1}; }},
      {"weights rows", "weights", [](P&, Prm&, S&, S&, S& w, S&, DType&, DType&, DType&) { w = {5, 2}; }},
      {"topk 0", "topk", [](P&, Prm& p, S&, S&, S&, S& i, DType&, DType&, DType&) { p.topk = 0; i = {10, 0}; }},
      {"topk -2", "topk", [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.topk = -2; }},
      {"cmp_ratio 0", "cmp_ratio", [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cmp_ratio = 0; }},
      {"scale NaN", "scale", [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.scale = std::nanf(""); }},
      {"indices topk", "indices", [](P&, Prm&, S&, S&, S&, S& i, DType&, DType&, DType&) { i = {10, 4}; }},
      {"indices dtype", "indices", [](P&, Prm&, S&, S&, S&, S&, DType& d, DType&, DType&) { d = DType::i64; }},
      {"scores dtype", "scores", [](P&, Prm&, S&, S&, S&, S&, DType&, DType& d, DType&) { d = DType::bf16; }},
      {"query lengths non-monotone", "query_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_q = {0, 6, 4, 10}; p.cu_seqlens_k = {0, 5, 5, 13}; }},
      {"query lengths last != T", "query_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_q = {0, 4, 9}; }},
      {"query lengths without leading 0", "query_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_q = {4, 10}; }},
      {"key lengths last != S", "key_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_k = {0, 5, 12}; }},
      {"key lengths count", "key_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_k = {0, 13}; }},
      {"Lq > Lk", "query_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_k = {0, 3, 13}; }},
      {"compressed rows inconsistent", "key_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cmp_ratio = 4; }},  // 5//4 + 8//4 = 3 != 13
  };
  for (const auto& b : bad) expect_rejected(tnd, b);

  Case bsnd;
  bsnd.layout = Layout::BSND;
  bsnd.q_lens = {4, 6};
  bsnd.k_lens = {5, 8};
  bsnd.sq = 6;
  bsnd.sk = 8;
  bsnd.heads = 2;
  bsnd.dim = 16;
  bsnd.topk = 3;
  std::vector<BadCall> bad_bsnd = {
      {"BSND query rank", "index_query", [](P&, Prm&, S& q, S&, S&, S&, DType&, DType&, DType&) { q = {12, 2, 16}; }},
      {"BSND batch of keys", "index_key", [](P&, Prm&, S&, S& k, S&, S&, DType&, DType&, DType&) { k = {1, 16, 16}; }},
      {"BSND query lengths count", "query_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_q = {0, 4, 10, 12}; }},
      {"BSND key lengths count", "key_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_k = {0, 5}; }},
      {"BSND row longer than Sq", "query_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_q = {0, 7, 13}; p.cu_seqlens_k = {0, 8, 16}; }},
      {"BSND row longer than Sk", "key_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_k = {0, 9, 17}; }},
      {"BSND Lq > Lk", "query_lengths",
       [](P&, Prm& p, S&, S&, S&, S&, DType&, DType&, DType&) { p.cu_seqlens_k = {0, 3, 11}; }},
      {"BSND indices shape", "indices", [](P&, Prm&, S&, S&, S&, S& i, DType&, DType&, DType&) { i = {12, 3}; }},
  };
  for (const auto& b : bad_bsnd) expect_rejected(bsnd, b);
}

TEST(Indexer, CudaBackendIsNotBuiltAndSaysSo) {
  Case c;
  c.q_lens = {4};
  c.heads = 1;
  c.dim = 8;
  c.topk = 2;
  Problem p = make_problem(c, DType::f32, Fill::normal, 1);
  std::vector<std::int32_t> idx(8, 12345);
  try {
    dsa::indexer_topk(p.q.view(), p.k.view(), p.w.view(), p.params, view_of(idx, DType::i32, p.idx_shape),
                      TensorView{}, dsa::Backend::cuda);
    ADD_FAILURE() << "cuda accepted";
  } catch (const dsa::Error& e) {
    EXPECT_EQ(e.kind(), dsa::ErrorKind::unsupported);
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos);
  }
  EXPECT_TRUE(std::all_of(idx.begin(), idx.end(), [](std::int32_t v) { return v == 12345; }));
}

// Found by fuzz_indexer (corpus: regression-topk-overflow-*): with no query
// rows, indices [0, topk] is empty for any topk, and the fused backend's
// candidate capacity 2 * topk overflowed int64 (here into a negative size,
// std::length_error). Without rows there is nothing to do.
TEST(Indexer, NoQueryRowsWithHugeTopk) {
  std::uint16_t q = 0, k = 0, w = 0;
  std::int32_t idx = 0;
  dsa::IndexerParams params;
  params.topk = (std::int64_t{1} << 62) + 1;
  TensorView indices = dsa::make_view(&idx, DType::i32, {0, 1});
  indices.shape[1] = params.topk;
  indices.strides[0] = params.topk;
  for (dsa::Backend backend : {dsa::Backend::reference, dsa::Backend::cpu})
    dsa::indexer_topk(dsa::make_view(&q, DType::bf16, {0, 1, 1}), dsa::make_view(&k, DType::bf16, {0, 1}),
                      dsa::make_view(&w, DType::bf16, {0, 1}), params, indices, TensorView{}, backend);
}

// ---- sequence planning ----------------------------------------------------

TEST(PlanSequences, TndRawKeys) {
  CuSeqlens cu_q{0, 2, 2, 5}, cu_k{0, 4, 4, 9};
  dsa::core::LengthSpec spec;
  spec.q_extent = 5;
  spec.k_extent = 9;
  spec.cu_q = &cu_q;
  spec.cu_k = &cu_k;
  const auto plan = dsa::core::plan_sequences(spec);
  ASSERT_EQ(plan.seqs.size(), 3u);
  EXPECT_EQ(plan.q_rows, 5);
  const std::int64_t want[3][6] = {{0, 2, 0, 4, 0, 4}, {2, 0, 4, 0, 4, 0}, {2, 3, 4, 5, 4, 5}};
  for (int b = 0; b < 3; ++b) {
    const auto& s = plan.seqs[b];
    EXPECT_EQ(s.q_begin, want[b][0]);
    EXPECT_EQ(s.q_len, want[b][1]);
    EXPECT_EQ(s.k_begin, want[b][2]);
    EXPECT_EQ(s.k_len, want[b][3]);
    EXPECT_EQ(s.c_begin, want[b][4]);  // raw keys: the compressed view is the raw one
    EXPECT_EQ(s.c_len, want[b][5]);
  }
  EXPECT_EQ(plan.seqs[0].position(0), 2);  // bottom-right: Lk - Lq + i
  EXPECT_EQ(plan.seqs[2].position(2), 4);
  EXPECT_TRUE(dsa::core::padding_rows(plan).empty());
}

TEST(PlanSequences, TndCompressedAndDefaults) {
  CuSeqlens cu_q{0, 3, 10}, cu_k{0, 4, 13};
  dsa::core::LengthSpec spec;
  spec.q_extent = 10;
  spec.c_extent = 1 + 2;  // 4 // 4 + 9 // 4
  spec.ratio = 4;
  spec.cu_q = &cu_q;
  spec.cu_k = &cu_k;
  auto plan = dsa::core::plan_sequences(spec);
  ASSERT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.seqs[0].c_begin, 0);
  EXPECT_EQ(plan.seqs[0].c_len, 1);
  EXPECT_EQ(plan.seqs[1].c_begin, 1);
  EXPECT_EQ(plan.seqs[1].c_len, 2);
  EXPECT_EQ(plan.seqs[1].k_len, 9);

  // No key lengths with compressed keys: the raw keys are the queries' own tokens.
  CuSeqlens none;
  spec.cu_k = &none;
  spec.c_extent = 0 + 1;  // 3 // 4 + 7 // 4
  plan = dsa::core::plan_sequences(spec);
  EXPECT_EQ(plan.seqs[0].k_len, 3);
  EXPECT_EQ(plan.seqs[1].k_len, 7);
  EXPECT_EQ(plan.seqs[1].c_len, 1);

  // No lengths at all: one sequence covering everything.
  dsa::core::LengthSpec whole;
  whole.q_extent = 6;
  whole.k_extent = 11;
  whole.cu_q = &none;
  whole.cu_k = &none;
  plan = dsa::core::plan_sequences(whole);
  ASSERT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].q_len, 6);
  EXPECT_EQ(plan.seqs[0].k_len, 11);
  EXPECT_EQ(plan.seqs[0].position(0), 5);
}

TEST(PlanSequences, BsndPaddingRows) {
  CuSeqlens cu_q{0, 3, 8}, cu_k{0, 7, 12};
  dsa::core::LengthSpec spec;
  spec.layout = Layout::BSND;
  spec.batch = 2;
  spec.q_extent = 5;
  spec.k_extent = 7;
  spec.cu_q = &cu_q;
  spec.cu_k = &cu_k;
  const auto plan = dsa::core::plan_sequences(spec);
  ASSERT_EQ(plan.seqs.size(), 2u);
  EXPECT_EQ(plan.q_rows, 10);
  EXPECT_EQ(plan.seqs[1].q_begin, 5);
  EXPECT_EQ(plan.seqs[1].k_begin, 7);
  EXPECT_EQ(plan.seqs[1].k_len, 5);
  EXPECT_EQ(dsa::core::padding_rows(plan), (std::vector<std::int64_t>{3, 4}));
}

// Found by fuzz_indexer (corpus: regression-length-end-overflow-*): the error
// for a decreasing cumulative end printed the sequence's length, end minus
// start, which overflows int64 for an end of INT64_MIN; it gives both ends.
TEST(PlanSequences, ExtremeDecreasingEndNamedWithoutOverflow) {
  const CuSeqlens cu_q{0, 9, std::numeric_limits<std::int64_t>::min()};
  dsa::core::LengthSpec spec;
  spec.q_extent = 9;
  spec.k_extent = 9;
  spec.cu_q = &cu_q;
  try {
    dsa::core::plan_sequences(spec);
    ADD_FAILURE() << "accepted a decreasing end";
  } catch (const dsa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ends at -9223372036854775808 before its start 9"), std::string::npos)
        << e.what();
  }
}

TEST(PlanSequences, RejectsInconsistentLengths) {
  auto rejects = [](CuSeqlens cu_q, CuSeqlens cu_k, std::int64_t qx, std::int64_t kx, const char* arg) {
    dsa::core::LengthSpec spec;
    spec.q_extent = qx;
    spec.k_extent = kx;
    spec.cu_q = &cu_q;
    spec.cu_k = &cu_k;
    try {
      dsa::core::plan_sequences(spec);
      ADD_FAILURE() << "accepted, expected an error naming " << arg;
    } catch (const dsa::Error& e) {
      EXPECT_EQ(e.kind(), dsa::ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(arg), std::string::npos) << e.what();
    }
  };
  rejects({0, 3, 2}, {0, 3, 3}, 2, 3, "query_lengths");  // decreasing
  rejects({0, 3}, {0, 2}, 3, 2, "query_lengths");        // Lq > Lk
  rejects({0, 3}, {0, 3}, 4, 3, "query_lengths");        // last end != T
  rejects({0, 3}, {0, 3}, 3, 5, "key_lengths");          // last end != S
  rejects({0, 1, 3}, {0, 3}, 3, 3, "key_lengths");       // count mismatch
}

}  // namespace
