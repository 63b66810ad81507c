// Fused CPU sparse attention against the reference backend, in every mode:
// explicit indices (+ split rope), dense causal with prefix KV, sliding window
// with sinks, window + compressed KV (HCA and CSA); TND and BSND; fp32 and
// bf16; every ISA path; determinism across thread counts; bad inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/cpu_features.h"
#include "core/numeric.h"
#include "cpu/sparse_attention/attention_kernels.h"
#include "dsa/error.h"
#include "dsa/sparse_attention.h"
#include "isa_paths.h"
#include "nan_placement.h"

namespace dsa {
namespace {

struct Buffer {
  DType dtype = DType::f32;
  std::vector<std::uint8_t> bytes;
  std::vector<std::int64_t> shape;
  TensorView view() { return make_view(bytes.data(), dtype, shape); }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  float at(std::int64_t i) const { return core::load_float(bytes.data(), dtype, i); }
};

Buffer make(DType dtype, std::vector<std::int64_t> shape) {
  Buffer b;
  b.dtype = dtype;
  b.shape = std::move(shape);
  b.bytes.assign(b.numel() * dtype_size(dtype), 0);
  return b;
}

Buffer random_float(DType dtype, std::vector<std::int64_t> shape, std::mt19937& gen, float scale = 1.0f) {
  Buffer b = make(dtype, std::move(shape));
  std::normal_distribution<float> dist(0.0f, scale);
  for (std::int64_t i = 0; i < b.numel(); ++i) core::store_float(b.bytes.data(), dtype, i, dist(gen));
  return b;
}

Buffer random_indices(std::vector<std::int64_t> shape, std::int64_t lo, std::int64_t hi, std::mt19937& gen) {
  Buffer b = make(DType::i32, std::move(shape));
  std::uniform_int_distribution<std::int64_t> dist(lo, hi);
  auto* p = reinterpret_cast<std::int32_t*>(b.bytes.data());
  for (std::int64_t i = 0; i < b.numel(); ++i) p[i] = static_cast<std::int32_t>(dist(gen));
  return b;
}

struct Config {
  DType dtype = DType::f32;
  Layout layout = Layout::TND;
  std::int64_t heads = 3, dim = 40, rope = 0, d_v = 0, batch = 1, sq = 0, sk = 0;
  std::vector<std::int64_t> q_lens, k_lens;  // per sequence / batch row
  std::int64_t topk = 0;                     // > 0: explicit indices
  std::int64_t window = 0;
  std::int64_t ratio = 1;                    // > 1: cmp_kv
  std::int64_t cmp_topk = 0;                 // > 0: cmp_indices
  bool sinks = false;
  float sink_value = NAN;                    // NAN: random sinks
};

struct Problem {
  Config c;
  Buffer query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope, grad_out;
  SparseAttentionParams params;
  SparseAttentionInputs inputs() {
    SparseAttentionInputs in;
    in.query = query.view();
    in.kv = kv.view();
    if (c.topk) in.indices = indices.view();
    if (c.ratio > 1) in.cmp_kv = cmp_kv.view();
    if (c.cmp_topk) in.cmp_indices = cmp_indices.view();
    if (c.sinks) in.sinks = sinks.view();
    if (c.rope) {
      in.query_rope = query_rope.view();
      in.key_rope = key_rope.view();
    }
    return in;
  }
};

// Maps every index of a sequence's rows into [-1, its key count) (compressed
// entries when ratio > 1): the ops refuse positions the sequence does not hold.
// Entries past a row's causal position stay, as do -1 and duplicates, which the
// ops skip or count. BSND padding rows keep whatever they hold (never read).
void fold_into_sequences(Buffer& idx, const Config& c, std::int64_t topk, std::int64_t ratio) {
  auto* v = reinterpret_cast<std::int32_t*>(idx.bytes.data());
  std::int64_t row0 = 0;
  for (std::size_t b = 0; b < c.q_lens.size(); ++b) {
    const std::int64_t held = c.k_lens[b] / ratio;
    for (std::int64_t i = 0; i < c.q_lens[b]; ++i)
      for (std::int64_t k = 0; k < topk; ++k) {
        std::int32_t& x = v[(row0 + i) * topk + k];
        x = static_cast<std::int32_t>((x + 1) % (held + 1)) - 1;
      }
    row0 += c.layout == Layout::TND ? c.q_lens[b] : c.sq;
  }
}

Problem build(const Config& c, unsigned seed) {
  std::mt19937 gen(seed);
  Problem p;
  p.c = c;
  const bool tnd = c.layout == Layout::TND;
  std::int64_t T = 0, S = 0, C = 0, max_k = 0;
  for (std::size_t b = 0; b < c.q_lens.size(); ++b) {
    T += c.q_lens[b];
    S += c.k_lens[b];
    C += c.ratio > 1 ? c.k_lens[b] / c.ratio : 0;
    max_k = std::max(max_k, c.k_lens[b]);
  }
  std::vector<std::int64_t> qlead = tnd ? std::vector<std::int64_t>{T} : std::vector<std::int64_t>{c.batch, c.sq};
  std::vector<std::int64_t> klead = tnd ? std::vector<std::int64_t>{S} : std::vector<std::int64_t>{c.batch, c.sk};
  std::vector<std::int64_t> clead = tnd ? std::vector<std::int64_t>{C} : std::vector<std::int64_t>{c.batch, c.sk / std::max<std::int64_t>(c.ratio, 1)};
  auto with = [](std::vector<std::int64_t> lead, std::initializer_list<std::int64_t> tail) {
    for (auto t : tail) lead.push_back(t);
    return lead;
  };
  const float qscale = 1.0f;
  p.query = random_float(c.dtype, with(qlead, {c.heads, c.dim}), gen, qscale);
  p.kv = random_float(c.dtype, with(klead, {c.dim}), gen);
  if (c.topk) {
    p.indices = random_indices(with(qlead, {c.topk}), -1, max_k - 1, gen);
    fold_into_sequences(p.indices, c, c.topk, 1);
  }
  if (c.ratio > 1) {
    p.cmp_kv = random_float(c.dtype, with(clead, {c.dim}), gen);
    if (c.cmp_topk) {
      p.cmp_indices = random_indices(with(qlead, {c.cmp_topk}), -1, max_k / c.ratio, gen);
      fold_into_sequences(p.cmp_indices, c, c.cmp_topk, c.ratio);
    }
  }
  if (c.sinks) {
    p.sinks = random_float(DType::f32, {c.heads}, gen);
    if (!std::isnan(c.sink_value))
      for (std::int64_t h = 0; h < c.heads; ++h) core::store_float(p.sinks.bytes.data(), DType::f32, h, c.sink_value);
  }
  if (c.rope) {
    p.query_rope = random_float(c.dtype, with(qlead, {c.heads, c.rope}), gen);
    p.key_rope = random_float(c.dtype, with(klead, {c.rope}), gen);
  }
  const std::int64_t dv = c.d_v ? c.d_v : c.dim;
  p.grad_out = random_float(c.dtype, with(qlead, {c.heads, dv}), gen);
  p.params.scale = 1.0f / std::sqrt(static_cast<float>(c.dim + c.rope));
  p.params.d_v = c.d_v;
  p.params.window = c.window;
  p.params.cmp_ratio = c.ratio;
  p.params.layout = c.layout;
  if (tnd) {
    p.params.cu_seqlens_q = {0};
    p.params.cu_seqlens_k = {0};
    for (std::size_t b = 0; b < c.q_lens.size(); ++b) {
      p.params.cu_seqlens_q.push_back(p.params.cu_seqlens_q.back() + c.q_lens[b]);
      p.params.cu_seqlens_k.push_back(p.params.cu_seqlens_k.back() + c.k_lens[b]);
    }
  } else {
    p.params.cu_seqlens_q = {0};
    p.params.cu_seqlens_k = {0};
    for (std::int64_t b = 0; b < c.batch; ++b) {
      p.params.cu_seqlens_q.push_back(p.params.cu_seqlens_q.back() + c.q_lens[b]);
      p.params.cu_seqlens_k.push_back(p.params.cu_seqlens_k.back() + c.k_lens[b]);
    }
  }
  return p;
}

struct Results {
  Buffer out, max, sum, dq, dkv, dqr, dkr, dcmp, dsinks;
};

// before_bwd, if given, runs between the forward and the backward (to hand the
// backward inputs the forward did not see).
Results run(Problem& p, Backend backend, int threads, const std::function<void()>& before_bwd = {}) {
  p.params.num_threads = threads;
  Results r;
  SparseAttentionInputs in = p.inputs();
  std::vector<std::int64_t> stat_shape(p.query.shape.begin(), p.query.shape.end() - 1);
  std::vector<std::int64_t> out_shape = stat_shape;
  out_shape.push_back(p.grad_out.shape.back());
  r.out = make(p.c.dtype, out_shape);
  r.max = make(DType::f32, stat_shape);
  r.sum = make(DType::f32, stat_shape);
  sparse_attention_fwd(in, p.params, r.out.view(), r.max.view(), r.sum.view(), backend);
  r.dq = make(p.c.dtype, p.query.shape);
  r.dkv = make(p.c.dtype, p.kv.shape);
  SparseAttentionGrads g;
  g.d_query = r.dq.view();
  g.d_kv = r.dkv.view();
  if (p.c.rope) {
    r.dqr = make(p.c.dtype, p.query_rope.shape);
    r.dkr = make(p.c.dtype, p.key_rope.shape);
    g.d_query_rope = r.dqr.view();
    g.d_key_rope = r.dkr.view();
  }
  if (p.c.ratio > 1) {
    r.dcmp = make(p.c.dtype, p.cmp_kv.shape);
    g.d_cmp_kv = r.dcmp.view();
  }
  if (p.c.sinks) {
    r.dsinks = make(DType::f32, {p.c.heads});
    g.d_sinks = r.dsinks.view();
  }
  if (before_bwd) before_bwd();
  sparse_attention_bwd(in, p.params, p.grad_out.view(), r.out.view(), r.max.view(), r.sum.view(), g, backend);
  return r;
}

// max |a - b| <= atol + rtol * max |b|, infinities in the same places.
void expect_close(const Buffer& a, const Buffer& b, double rtol, double atol, const char* what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  double scale = 0.0, worst = 0.0;
  for (std::int64_t i = 0; i < b.numel(); ++i)
    if (std::isfinite(b.at(i))) scale = std::max(scale, std::fabs(static_cast<double>(b.at(i))));
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const float x = a.at(i), y = b.at(i);
    if (std::isinf(y) || std::isinf(x)) {
      ASSERT_EQ(x, y) << what << " at " << i;
      continue;
    }
    ASSERT_FALSE(std::isnan(x)) << what << " at " << i;
    worst = std::max(worst, std::fabs(static_cast<double>(x) - y));
  }
  EXPECT_LE(worst, atol + rtol * scale) << what << " (scale " << scale << ")";
}

void expect_identical(const Buffer& a, const Buffer& b, const char* what) {
  EXPECT_EQ(a.bytes, b.bytes) << what;
}

void compare_all(const Results& f, const Results& r, const Config& c) {
  const double rtol = c.dtype == DType::f32 ? 1e-4 : 2e-2, atol = c.dtype == DType::f32 ? 1e-5 : 1e-3;
  expect_close(f.out, r.out, rtol, atol, "out");
  expect_close(f.max, r.max, 1e-4, 1e-5, "softmax_max");
  expect_close(f.sum, r.sum, rtol, atol, "softmax_sum");
  expect_close(f.dq, r.dq, rtol, atol, "d_query");
  expect_close(f.dkv, r.dkv, rtol, atol, "d_kv");
  if (c.rope) {
    expect_close(f.dqr, r.dqr, rtol, atol, "d_query_rope");
    expect_close(f.dkr, r.dkr, rtol, atol, "d_key_rope");
  }
  if (c.ratio > 1) expect_close(f.dcmp, r.dcmp, rtol, atol, "d_cmp_kv");
  if (c.sinks) expect_close(f.dsinks, r.dsinks, c.dtype == DType::f32 ? 1e-4 : 3e-2, 1e-4, "d_sinks");
}

void check_config(const Config& c, unsigned seed = 1) {
  Problem p = build(c, seed);
  Results ref = run(p, Backend::reference, 1);
  Results fused1 = run(p, Backend::cpu, 1);
  compare_all(fused1, ref, c);
  Results fused3 = run(p, Backend::cpu, 3);
  for (auto [a, b, name] : {std::tuple{&fused1.out, &fused3.out, "out"}, std::tuple{&fused1.dq, &fused3.dq, "dq"},
                            std::tuple{&fused1.dkv, &fused3.dkv, "dkv"}, std::tuple{&fused1.dcmp, &fused3.dcmp, "dcmp"},
                            std::tuple{&fused1.dkr, &fused3.dkr, "dkr"}, std::tuple{&fused1.dsinks, &fused3.dsinks, "dsinks"}})
    expect_identical(*a, *b, name);
  // The backward in chunks of 5 query rows (blocks carry fp32 sums across
  // chunks, implicit sets are cut at chunk edges) adds the same terms in the
  // same order as in one pass: identical gradients, with any thread count.
  cpu::attention_kernels::limit_backward_chunk_rows_for_testing(5);
  Results chunked = run(p, Backend::cpu, 2);
  cpu::attention_kernels::limit_backward_chunk_rows_for_testing(0);
  for (auto [a, b, name] : {std::tuple{&fused1.dq, &chunked.dq, "chunked dq"}, std::tuple{&fused1.dkv, &chunked.dkv, "chunked dkv"},
                            std::tuple{&fused1.dcmp, &chunked.dcmp, "chunked dcmp"}, std::tuple{&fused1.dkr, &chunked.dkr, "chunked dkr"},
                            std::tuple{&fused1.dsinks, &chunked.dsinks, "chunked dsinks"}})
    expect_identical(*a, *b, name);
  // Kernels that keep P and dS between the backward's passes recompute them
  // where a row is too long to keep: that path, chunked too, against the reference.
  cpu::attention_kernels::recompute_backward_weights_for_testing(true);
  cpu::attention_kernels::limit_backward_chunk_rows_for_testing(5);
  Results recomputed = run(p, Backend::cpu, 2);
  cpu::attention_kernels::limit_backward_chunk_rows_for_testing(0);
  cpu::attention_kernels::recompute_backward_weights_for_testing(false);
  compare_all(recomputed, ref, c);
}

Config tnd(std::vector<std::int64_t> q, std::vector<std::int64_t> k) {
  Config c;
  c.q_lens = q;
  c.k_lens = k;
  return c;
}

// BSND: one batch row per sequence, padded to sq queries and sk keys.
Config bsnd(std::int64_t sq, std::int64_t sk, std::vector<std::int64_t> q, std::vector<std::int64_t> k) {
  Config c = tnd(std::move(q), std::move(k));
  c.layout = Layout::BSND;
  c.batch = static_cast<std::int64_t>(c.q_lens.size());
  c.sq = sq;
  c.sk = sk;
  return c;
}

// An ISA parameter past amx: avx512_bf16 with the pair kernels' own bf16 forward, the
// AMX forward's algorithm on vdpbf16ps (so AVX512-BF16 machines test it too).
constexpr int kPairForwardOnBf16Dots = static_cast<int>(core::Isa::amx) + 1;

class SparseAttentionModes : public ::testing::TestWithParam<std::tuple<DType, int>> {
 protected:
  void SetUp() override {
    const int isa = std::get<1>(GetParam());
    const bool pairs = isa == kPairForwardOnBf16Dots;
    const core::Isa needs = pairs ? core::Isa::avx512_bf16 : static_cast<core::Isa>(isa);
    if (const std::string why = dsa_testing::skip_reason(needs); !why.empty()) GTEST_SKIP() << why;
    core::limit_isa_for_testing(needs);
    cpu::attention_kernels::use_pair_forward_for_testing(pairs);
  }
  void TearDown() override {
    core::limit_isa_for_testing(core::Isa::amx);
    cpu::attention_kernels::use_pair_forward_for_testing(false);
  }
  DType dtype() const { return std::get<0>(GetParam()); }
};

TEST_P(SparseAttentionModes, ExplicitIndicesWithRope) {
  Config c = tnd({5, 0, 1, 17}, {9, 3, 1, 40});
  c.dtype = dtype();
  c.heads = 3;
  c.dim = 36;
  c.rope = 8;
  c.d_v = 32;
  c.topk = 11;
  check_config(c);
}

TEST_P(SparseAttentionModes, ExplicitIndicesSharedValueDims) {
  Config c = tnd({33}, {70});
  c.dtype = dtype();
  c.heads = 16;
  c.dim = 72;
  c.d_v = 64;
  c.topk = 40;
  check_config(c, 2);
}

TEST_P(SparseAttentionModes, ManyHeadsWideRows) {
  // Several (odd) head groups, value dims not a multiple of 32, rope dims:
  // every tile-edge branch of the AMX kernels.
  Config c = tnd({20, 70}, {30, 100});
  c.dtype = dtype();
  c.heads = 40;
  c.dim = 96;
  c.rope = 32;
  c.d_v = 80;
  c.topk = 45;
  check_config(c, 13);
}

TEST_P(SparseAttentionModes, ManyHeadsDense) {
  Config c = tnd({67}, {140});
  c.dtype = dtype();
  c.heads = 33;
  c.dim = 48;
  c.window = 70;
  c.sinks = true;
  check_config(c, 14);
}

TEST_P(SparseAttentionModes, DenseCausalPrefix) {
  Config c = tnd({7, 2, 65}, {7, 9, 97});
  c.dtype = dtype();
  c.heads = 2;
  c.dim = 33;
  check_config(c, 3);
}

TEST_P(SparseAttentionModes, WindowWithSinks) {
  Config c = tnd({70, 1}, {70, 5});
  c.dtype = dtype();
  c.heads = 4;
  c.dim = 32;
  c.window = 9;
  c.sinks = true;
  check_config(c, 4);
}

TEST_P(SparseAttentionModes, WindowCompressedAll) {
  Config c = tnd({45, 3, 2}, {45, 3, 20});
  c.dtype = dtype();
  c.heads = 3;
  c.dim = 24;
  c.window = 6;
  c.ratio = 4;
  c.sinks = true;
  check_config(c, 5);
}

TEST_P(SparseAttentionModes, WindowCompressedIndices) {
  Config c = tnd({40, 12}, {50, 12});
  c.dtype = dtype();
  c.heads = 5;
  c.dim = 32;
  c.window = 8;
  c.ratio = 4;
  c.cmp_topk = 6;
  c.sinks = true;
  check_config(c, 6);
}

TEST_P(SparseAttentionModes, CompressedIndicesMoreThanEntries) {
  // More cmp_indices than compressed entries: duplicates must still all count.
  Config c = tnd({9, 2}, {9, 6});
  c.dtype = dtype();
  c.heads = 2;
  c.dim = 16;
  c.window = 3;
  c.ratio = 4;
  c.cmp_topk = 13;
  check_config(c, 12);
}

TEST_P(SparseAttentionModes, CompressedIndicesWithoutCompressedRows) {
  // Sequences shorter than the ratio: cmp_indices given, no compressed row to
  // attend (cmp_kv holds no data). The backward that keeps weights still walks
  // the compressed lists (found by the Python property test, where a review
  // edit read each row's raw count from a table sized only when cmp_kv had data).
  Config c = tnd({3, 2}, {3, 2});
  c.dtype = dtype();
  c.heads = 2;
  c.dim = 16;
  c.window = 2;
  c.ratio = 4;
  c.cmp_topk = 3;
  check_config(c, 23);
}

TEST_P(SparseAttentionModes, SparseIndicesOverLongSequences) {
  // Top-16 of up to 4200 keys: the backward widens its owned dkv blocks to
  // 2048 rows (owner_rows_for), pools a token's few entries across sub-blocks
  // and ends on a short last block; a 5-key sequence keeps a one-block case.
  Config c = tnd({9, 0, 4, 30}, {3000, 0, 5, 4200});
  c.dtype = dtype();
  c.heads = 16;
  c.dim = 48;
  c.rope = 16;
  c.d_v = 32;
  c.topk = 16;
  check_config(c, 21);
}

TEST_P(SparseAttentionModes, CompressedIndicesOverLongSequences) {
  // Top-8 of 2250 compressed entries: wide owned blocks on the compressed side,
  // the 256-row band blocks on the raw side.
  Config c = tnd({25}, {9000});
  c.dtype = dtype();
  c.heads = 4;
  c.dim = 32;
  c.window = 16;
  c.ratio = 4;
  c.cmp_topk = 8;
  c.sinks = true;
  check_config(c, 22);
}

TEST_P(SparseAttentionModes, BsndPaddedIndices) {
  Config c = bsnd(6, 10, {6, 0, 3}, {10, 4, 3});
  c.dtype = dtype();
  c.heads = 2;
  c.dim = 20;
  c.topk = 7;
  check_config(c, 7);
}

TEST_P(SparseAttentionModes, BsndWindowCompressed) {
  Config c = bsnd(9, 12, {9, 4}, {12, 7});
  c.dtype = dtype();
  c.heads = 2;
  c.dim = 16;
  c.window = 4;
  c.ratio = 3;
  c.sinks = true;
  check_config(c, 8);
}

// NaN in the outputs and gradients exactly where the reference puts it, the
// numbers close to it. The reference's max leaves NaN logits out and its sum
// of exp(l - max) takes them in, so a NaN logit makes its head's output and
// softmax_sum NaN, and a head with only NaN logits (a NaN in the query) keeps
// max -inf with a NaN output: not an empty row's zeros. Its backward skips
// such a head. `some_nan`: the case must put NaN there.
void expect_same_nans(const Buffer& a, const Buffer& b, double rtol, double atol, const char* what,
                      bool some_nan = true) {
  const auto values = [](const Buffer& x) {
    std::vector<float> out(x.numel());
    for (std::int64_t i = 0; i < x.numel(); ++i) out[i] = x.at(i);
    return out;
  };
  const std::int64_t nans = dsa_testing::expect_same_non_finite(values(a), values(b), rtol, atol, what);
  if (some_nan) EXPECT_GT(nans, 0) << what << ": the case puts NaN there";
}

TEST_P(SparseAttentionModes, NanInTheInputsReachesWhatItReachesInTheReference) {
  Config indices = tnd({5, 23}, {9, 40});
  indices.dim = 48;
  indices.rope = 16;
  indices.d_v = 32;
  indices.topk = 11;
  Config window = tnd({70}, {70});  // keys in three blocks of the kernels
  window.heads = 4;
  window.dim = 32;
  window.window = 40;
  window.sinks = true;
  Config compressed = tnd({45}, {45});
  compressed.dim = 24;
  compressed.window = 6;
  compressed.ratio = 4;
  compressed.sinks = true;
  for (Config c : {indices, window, compressed}) {
    c.dtype = dtype();
    enum Where { kQuery, kKv, kCmpKv };
    // An infinite element makes logits +-inf: a +inf one takes the max and its exp(inf - inf)
    // is NaN; a -inf one weighs exactly 0, and its row's infinite value makes 0 * inf = NaN.
    for (Where where : {kQuery, kKv, kCmpKv})
    for (float special : {NAN, INFINITY, -INFINITY}) {
      if (where == kCmpKv && c.ratio == 1) continue;
      SCOPED_TRACE("dim " + std::to_string(c.dim) + ", " + std::to_string(special) + " in " +
                   (where == kQuery ? "query" : where == kKv ? "kv" : "cmp_kv"));
      Problem p = build(c, 11);
      Buffer& target = where == kQuery ? p.query : where == kKv ? p.kv : p.cmp_kv;
      // query: row 3, head 1 (all of that head's logits); kv: row 20
      // (attended in a later key block); cmp_kv: entry 2.
      const std::int64_t at = where == kQuery ? (3 * c.heads + 1) * c.dim + 5 : where == kKv ? 20 * c.dim + 2 : 2 * c.dim + 7;
      core::store_float(target.bytes.data(), c.dtype, at, special);
      const Results fused = run(p, Backend::cpu, 2), ref = run(p, Backend::reference, 1);
      const double rtol = c.dtype == DType::f32 ? 1e-4 : 2e-2, atol = c.dtype == DType::f32 ? 1e-5 : 1e-3;
      expect_same_nans(fused.out, ref.out, rtol, atol, "out");
      expect_same_nans(fused.sum, ref.sum, rtol, atol, "softmax_sum");
      expect_close(fused.max, ref.max, 1e-4, 1e-5, "softmax_max");  // never NaN: NaN logits are left out
      // A NaN query makes its head dead (max -inf), which the backward skips:
      // no NaN gradient then, only the placement of the others to check.
      const bool grads_nan = where != kQuery;
      expect_same_nans(fused.dq, ref.dq, rtol, atol, "d_query", grads_nan);
      expect_same_nans(fused.dkv, ref.dkv, rtol, atol, "d_kv", grads_nan);
      if (c.rope) {
        expect_same_nans(fused.dqr, ref.dqr, rtol, atol, "d_query_rope", grads_nan);
        expect_same_nans(fused.dkr, ref.dkr, rtol, atol, "d_key_rope", grads_nan);
      }
      if (c.ratio > 1) expect_same_nans(fused.dcmp, ref.dcmp, rtol, atol, "d_cmp_kv", grads_nan);
      if (c.sinks)
        expect_same_nans(fused.dsinks, ref.dsinks, c.dtype == DType::f32 ? 1e-4 : 3e-2, 1e-4, "d_sinks", grads_nan);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndIsas, SparseAttentionModes,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16),
                       ::testing::Values(static_cast<int>(core::Isa::portable), static_cast<int>(core::Isa::avx2),
                                         static_cast<int>(core::Isa::avx512),
                                         static_cast<int>(core::Isa::avx512_bf16),
                                         static_cast<int>(core::Isa::amx), kPairForwardOnBf16Dots)));

TEST(SparseAttention, SinkExtremes) {
  for (float sink : {-INFINITY, 0.0f, 60.0f, INFINITY}) {  // +inf: all the mass to the sink, outputs 0
    Config c = tnd({12}, {12});
    c.heads = 2;
    c.dim = 16;
    c.window = 5;
    c.sinks = true;
    c.sink_value = sink;
    check_config(c, 9);
  }
}

TEST(SparseAttention, AllInvalidIndicesGiveEmptyRows) {
  Config c = tnd({4}, {4});
  c.heads = 2;
  c.dim = 8;
  c.topk = 3;
  Problem p = build(c, 10);
  auto* idx = reinterpret_cast<std::int32_t*>(p.indices.bytes.data());
  for (int i = 0; i < 12; ++i) idx[i] = -1;
  idx[3 * 3 + 0] = 3;  // only the last row attends one key (itself)
  idx[3 * 3 + 2] = 3;  // ... twice: duplicates count twice
  Results r = run(p, Backend::cpu, 2);
  for (int i = 0; i < 3 * 2; ++i) {
    EXPECT_EQ(r.max.at(i), -INFINITY);
    EXPECT_EQ(r.sum.at(i), 0.0f);
  }
  EXPECT_EQ(r.sum.at(6), 2.0f);  // two copies of one key, both at the max
  for (int i = 0; i < 3 * 2 * 8; ++i) EXPECT_EQ(r.out.at(i), 0.0f);
  Results ref = run(p, Backend::reference, 1);
  compare_all(r, ref, c);
}

// Found by fuzz_sparse_attention (corpus: regression-empty-query-huge-heads-*):
// a query of no rows may claim any number of heads ([0, 2^40, 1] addresses
// nothing), and both backends sized scratch from H (the fused one terabytes,
// the reference backward its dsink accumulator): std::bad_alloc. With no rows
// the forward writes nothing and the backward only zeroes dkv.
TEST(SparseAttention, NoQueryRowsWithHugeHeadCount) {
  const std::int64_t heads = std::int64_t{1} << 40;
  std::uint16_t q = 0, out = 0, go = 0, dq = 0;
  float stat = 0;
  std::vector<std::uint16_t> kv(6, 0x3f80), dkv(6, 0x3f80);  // bf16 1.0: the backward must zero it
  auto empty_rows = [&](void* data, DType dtype, std::initializer_list<std::int64_t> shape) {
    dsa::TensorView v = dsa::make_view(data, dtype, shape);
    v.shape[1] = heads;
    for (int d = 0; d < v.ndim - 1; ++d) v.strides[d] = v.strides[d + 1] * v.shape[d + 1];
    return v;
  };
  dsa::SparseAttentionInputs in;
  in.query = empty_rows(&q, DType::bf16, {0, 1, 1});
  in.kv = dsa::make_view(kv.data(), DType::bf16, {6, 1});
  dsa::SparseAttentionParams params;
  params.cu_seqlens_q = {0, 0};
  params.cu_seqlens_k = {0, 6};
  for (dsa::Backend backend : {dsa::Backend::reference, dsa::Backend::cpu}) {
    dsa::sparse_attention_fwd(in, params, empty_rows(&out, DType::bf16, {0, 1, 1}),
                              empty_rows(&stat, DType::f32, {0, 1}), empty_rows(&stat, DType::f32, {0, 1}), backend);
    dsa::SparseAttentionGrads g;
    g.d_query = empty_rows(&dq, DType::bf16, {0, 1, 1});
    g.d_kv = dsa::make_view(dkv.data(), DType::bf16, {6, 1});
    dsa::sparse_attention_bwd(in, params, empty_rows(&go, DType::bf16, {0, 1, 1}),
                              empty_rows(&out, DType::bf16, {0, 1, 1}), empty_rows(&stat, DType::f32, {0, 1}),
                              empty_rows(&stat, DType::f32, {0, 1}), g, backend);
    for (std::uint16_t v : dkv) EXPECT_EQ(v, 0) << dsa::backend_name(backend);
    std::fill(dkv.begin(), dkv.end(), 0x3f80);
  }
}

// Found by fuzz_sparse_attention (corpus: regression-empty-huge-row-*): a query
// [0, 3, INT64_MAX] has no elements, but its non-zero sizes multiply past
// int64, which the output checks' contiguity test did (undefined behaviour).
// Such a view is rejected like any whose element count overflows.
TEST(SparseAttention, EmptyQueryWhoseRowSizeOverflowsIsRejected) {
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  std::uint16_t x = 0;
  float stat = 0;
  TensorView query = make_view(&x, DType::bf16, {0, 3, 1}), kv = make_view(&x, DType::bf16, {0, 1});
  query.shape[2] = kv.shape[1] = huge;
  TensorView out = query;
  SparseAttentionInputs in;
  in.query = query;
  in.kv = kv;
  SparseAttentionParams params;
  params.cu_seqlens_q = params.cu_seqlens_k = {0, 0};
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    try {
      sparse_attention_fwd(in, params, out, make_view(&stat, DType::f32, {0, 3}), make_view(&stat, DType::f32, {0, 3}),
                           backend);
      ADD_FAILURE() << "accepted a [0, 3, INT64_MAX] query";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("query"), std::string::npos) << e.what();
    }
  }
}

// Found by fuzz_sparse_attention (corpus: regression-huge-window-*): window =
// INT64_MAX is accepted and means "every causal key", but the fused backward's
// band arithmetic (first + count + window) overflowed, which here wrapped into
// an empty band and left dkv without its contributions. It must equal the
// dense causal window = 0, bit for bit.
TEST(SparseAttention, HugeWindowIsDenseCausal) {
  const std::int64_t T = 8, S = 80, H = 2, D = 8;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto random = [&](std::int64_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
  };
  std::vector<float> q = random(T * H * D), kv = random(S * D), go = random(T * H * D);
  SparseAttentionInputs in;
  in.query = make_view(q.data(), DType::f32, {T, H, D});
  in.kv = make_view(kv.data(), DType::f32, {S, D});
  std::vector<float> dkv[2];
  for (int run = 0; run < 2; ++run) {
    SparseAttentionParams params;
    params.scale = 0.3f;
    params.window = run == 0 ? 0 : std::numeric_limits<std::int64_t>::max();
    std::vector<float> out(T * H * D), mx(T * H), sm(T * H), dq(T * H * D);
    dkv[run].assign(S * D, -1.0f);
    sparse_attention_fwd(in, params, make_view(out.data(), DType::f32, {T, H, D}),
                         make_view(mx.data(), DType::f32, {T, H}), make_view(sm.data(), DType::f32, {T, H}),
                         Backend::cpu);
    SparseAttentionGrads g;
    g.d_query = make_view(dq.data(), DType::f32, {T, H, D});
    g.d_kv = make_view(dkv[run].data(), DType::f32, {S, D});
    sparse_attention_bwd(in, params, make_view(go.data(), DType::f32, {T, H, D}),
                         make_view(out.data(), DType::f32, {T, H, D}), make_view(mx.data(), DType::f32, {T, H}),
                         make_view(sm.data(), DType::f32, {T, H}), g, Backend::cpu);
  }
  EXPECT_EQ(dkv[0], dkv[1]);
  EXPECT_NE(dkv[0][(S - 1) * D], 0.0f);  // the last key is attended: its gradient is not 0
}

// A position outside the query's own sequence (at or past its key count, or
// below -1) is a caller's mistake, e.g. a global row passed for a position;
// both backends refuse it, forward and backward, naming the argument, instead of
// skipping it. BSND padding rows are never read, so they are not checked.
TEST(SparseAttention, IndicesOutsideTheirSequenceAreRefused) {
  // Sets *slot = bad before the forward, then (slot restored) between the
  // forward and the backward: each must refuse it on both backends.
  auto expect_refused = [](Problem& p, std::int32_t* slot, std::int32_t bad, const char* name,
                           const char* what) {
    const std::int32_t good = *slot;
    for (Backend backend : {Backend::cpu, Backend::reference})
      for (bool in_bwd : {false, true}) {
        *slot = in_bwd ? good : bad;
        try {
          run(p, backend, 2, [&] { *slot = bad; });
          ADD_FAILURE() << "no error for " << what << (in_bwd ? " (backward)" : " (forward)");
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
          EXPECT_EQ(std::string(e.what()).rfind(std::string(name) + ":", 0), 0u) << e.what();
          EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
      }
    *slot = good;
  };
  Config c = tnd({3, 4}, {5, 6});
  c.heads = 2;
  c.dim = 8;
  c.topk = 3;
  {
    Problem p = build(c, 21);
    std::int32_t* slot = reinterpret_cast<std::int32_t*>(p.indices.bytes.data()) + 4 * 3 + 1;
    // A valid row of the packed kv, but sequence 1 holds 6 keys.
    expect_refused(p, slot, 7, "indices", "is 7, outside the sequence's 6 keys");
    expect_refused(p, slot, -2, "indices", "is -2");
    *slot = 5;  // in range, past the row's position: skipped, not refused
    EXPECT_NO_THROW(run(p, Backend::cpu, 2));
  }
  c.ratio = 2;
  c.cmp_topk = 2;
  {
    Problem p = build(c, 22);
    // Sequence 0 has 5 // 2 = 2 compressed entries.
    expect_refused(p, reinterpret_cast<std::int32_t*>(p.cmp_indices.bytes.data()), 2, "cmp_indices",
                   "is 2, outside the sequence's 2 compressed entries");
  }
  Config b = bsnd(4, 6, {4, 2}, {6, 3});
  b.heads = 2;
  b.dim = 8;
  b.topk = 3;
  Problem p = build(b, 23);
  auto* idx = reinterpret_cast<std::int32_t*>(p.indices.bytes.data());
  idx[(4 + 3) * 3] = 1000;  // batch row 1, query 3: padding (its sequence has 2 queries)
  EXPECT_NO_THROW(run(p, Backend::cpu, 2));
  expect_refused(p, idx + (4 + 1) * 3, 3, "indices", "is 3, outside the sequence's 3 keys");
}

TEST(SparseAttention, BadInputsThrowAndWriteNothing) {
  Config c = tnd({4}, {6});
  c.heads = 2;
  c.dim = 8;
  c.topk = 3;
  Problem p = build(c, 11);
  Buffer out = make(DType::f32, {4, 2, 8}), mx = make(DType::f32, {4, 2}), sm = make(DType::f32, {4, 2});
  std::memset(out.bytes.data(), 0x7f, out.bytes.size());
  const auto before = out.bytes;
  auto expect_invalid = [&](SparseAttentionInputs in, SparseAttentionParams params, const char* needle) {
    try {
      sparse_attention_fwd(in, params, out.view(), mx.view(), sm.view(), Backend::cpu);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(out.bytes, before);
  };
  Buffer kv_bad = make(DType::f32, {6, 7});
  auto in = p.inputs();
  in.kv = kv_bad.view();
  expect_invalid(in, p.params, "kv");
  in = p.inputs();
  Buffer kv_bf16 = make(DType::bf16, {6, 8});
  in.kv = kv_bf16.view();
  expect_invalid(in, p.params, "kv");
  in = p.inputs();
  Buffer idx_bad = make(DType::i32, {3, 3});
  in.indices = idx_bad.view();
  expect_invalid(in, p.params, "indices");
  auto params = p.params;
  params.cu_seqlens_q = {0, 7};
  params.cu_seqlens_k = {0, 6};
  expect_invalid(p.inputs(), params, "query_lengths");
  params = p.params;
  params.cu_seqlens_k = {0, 3};
  expect_invalid(p.inputs(), params, "key_lengths");
  params = p.params;
  params.window = 4;
  expect_invalid(p.inputs(), params, "window");
  params = p.params;
  params.d_v = 9;
  expect_invalid(p.inputs(), params, "d_v");
  params = p.params;
  params.cmp_ratio = 4;
  expect_invalid(p.inputs(), params, "cmp_ratio");
  in = p.inputs();
  Buffer sinks_bad = make(DType::f32, {3});
  in.sinks = sinks_bad.view();
  expect_invalid(in, p.params, "sinks");
  in = p.inputs();
  Buffer qr = make(DType::f32, {4, 2, 4});
  in.query_rope = qr.view();
  expect_invalid(in, p.params, "key_rope");
  Buffer out_bad = make(DType::f32, {4, 2, 7});
  try {
    sparse_attention_fwd(p.inputs(), p.params, out_bad.view(), mx.view(), sm.view(), Backend::cpu);
    ADD_FAILURE() << "no error for a wrong out shape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out"), std::string::npos);
  }
}

}  // namespace
}  // namespace dsa
