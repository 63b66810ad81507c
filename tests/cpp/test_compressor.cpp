// Fused CPU compressor against the reference backend, every ISA path (portable,
// AVX2, AVX-512, AVX-512-BF16), both layouts, determinism across thread counts,
// and bad inputs.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/cpu_features.h"
#include "core/numeric.h"
#include "cpu/compressor/pool_kernels.h"
#include "dsa/compressor.h"
#include "dsa/error.h"
#include "isa_paths.h"

namespace {

using dsa::DType;

// Element storage whose data() starts on a 64-byte boundary, as tensors from
// PyTorch's allocator do (the fused backward streams whole aligned lines).
struct Buffer {
  DType dtype;
  std::size_t n;
  std::vector<std::uint16_t> half;
  std::vector<float> full;
  std::size_t offset = 0;  // elements before the data start
  // shift: elements between the 64-byte boundary and the data start (0: aligned).
  Buffer(DType d, std::size_t count, std::size_t shift = 0) : dtype(d), n(count) {
    if (d == DType::f32) full.assign(n + 16 + shift, 0.0f); else half.assign(n + 32 + shift, 0);
    const auto address = reinterpret_cast<std::uintptr_t>(d == DType::f32 ? static_cast<void*>(full.data()) : half.data());
    offset = ((64 - address % 64) % 64) / (d == DType::f32 ? 4 : 2) + shift;
  }
  void* data() { return dtype == DType::f32 ? static_cast<void*>(full.data() + offset) : half.data() + offset; }
  const void* data() const { return const_cast<Buffer*>(this)->data(); }
  std::size_t size() const { return n; }
  float get(std::size_t i) const { return dsa::core::load_float(data(), dtype, i); }
  // The elements' bits, without the padding around the aligned start (its
  // length depends on where the allocator put the vector).
  std::vector<std::uint32_t> bits() const {
    std::vector<std::uint32_t> b(n);
    for (std::size_t i = 0; i < n; ++i)
      b[i] = dtype == DType::f32 ? std::bit_cast<std::uint32_t>(full[offset + i]) : half[offset + i];
    return b;
  }
  void set(std::size_t i, float v) { dsa::core::store_float(data(), dtype, i, v); }
};

struct Case {
  dsa::Layout layout = dsa::Layout::TND;
  std::int64_t ratio = 4;
  bool overlap = true;
  std::int64_t c = 24;
  std::vector<std::int64_t> lengths;  // per sequence (TND) / per row (BSND)
  std::int64_t batch = 1, rows = 0;   // BSND: B, Sk
  DType dtype = DType::f32;
  std::size_t shift = 0;  // every tensor starts this many elements past a 64-byte boundary
};

struct Outputs {
  Buffer compressed, grad_kv, grad_gate;
  std::vector<float> grad_bias;
  std::vector<float> stats;  // [out_rows, 3, c] when the run saved them
};

struct Problem {
  Case k;
  std::int64_t C, S, out_rows;
  Buffer kv, gate, grad_out;
  std::vector<float> bias;
  dsa::CompressorParams params;

  explicit Problem(const Case& cs, std::uint32_t seed = 7)
      : k(cs), C((cs.overlap ? 2 : 1) * cs.c),
        S(cs.layout == dsa::Layout::TND ? total(cs.lengths) : cs.batch * cs.rows),
        out_rows(cs.layout == dsa::Layout::TND ? compressed_total(cs) : cs.batch * (cs.rows / cs.ratio)),
        kv(cs.dtype, S * C, cs.shift), gate(cs.dtype, S * C, cs.shift), grad_out(cs.dtype, out_rows * cs.c, cs.shift),
        bias(cs.ratio * C) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (std::size_t i = 0; i < kv.size(); ++i) kv.set(i, n(rng));
    for (std::size_t i = 0; i < gate.size(); ++i) gate.set(i, 2.0f * n(rng));
    for (std::size_t i = 0; i < grad_out.size(); ++i) grad_out.set(i, n(rng));
    for (auto& b : bias) b = n(rng);
    params.ratio = cs.ratio;
    params.overlap = cs.overlap;
    params.layout = cs.layout;
    params.cu_seqlens = {0};
    for (auto l : cs.lengths) params.cu_seqlens.push_back(params.cu_seqlens.back() + l);
  }
  static std::int64_t total(const std::vector<std::int64_t>& v) {
    std::int64_t s = 0;
    for (auto x : v) s += x;
    return s;
  }
  static std::int64_t compressed_total(const Case& cs) {
    std::int64_t s = 0;
    for (auto x : cs.lengths) s += x / cs.ratio;
    return s;
  }
  dsa::TensorView view2(Buffer& b, std::int64_t cols) {
    return k.layout == dsa::Layout::TND
               ? dsa::make_view(b.data(), b.dtype, {static_cast<std::int64_t>(b.size()) / cols, cols})
               : dsa::make_view(b.data(), b.dtype, {k.batch, static_cast<std::int64_t>(b.size()) / cols / k.batch, cols});
  }
  // with_stats: the forward saves the softmax statistics and the backward
  // starts from them.
  Outputs run(dsa::Backend backend, int threads = 0, bool with_stats = false) {
    Outputs r{Buffer(k.dtype, out_rows * k.c, k.shift), Buffer(k.dtype, S * C, k.shift), Buffer(k.dtype, S * C, k.shift),
          std::vector<float>(bias.size(), 123.0f), {}};
    for (std::size_t i = 0; i < r.compressed.size(); ++i) r.compressed.set(i, 99.0f);  // must be overwritten
    for (std::size_t i = 0; i < r.grad_kv.size(); ++i) { r.grad_kv.set(i, 99.0f); r.grad_gate.set(i, 99.0f); }
    dsa::CompressorParams p = params;
    p.num_threads = threads;
    auto pb = dsa::make_view(bias.data(), DType::f32, {k.ratio, C});
    const auto grad_bias = dsa::make_view(r.grad_bias.data(), DType::f32, {k.ratio, C});
    if (!with_stats) {
      dsa::compressor_fwd(view2(kv, C), view2(gate, C), pb, p, view2(r.compressed, k.c), backend);
      dsa::compressor_bwd(view2(grad_out, k.c), view2(kv, C), view2(gate, C), pb, p, view2(r.grad_kv, C),
                          view2(r.grad_gate, C), grad_bias, backend);
      return r;
    }
    r.stats.assign(out_rows * 3 * k.c, 77.0f);  // must be overwritten
    const auto stats = k.layout == dsa::Layout::TND
                           ? dsa::make_view(r.stats.data(), DType::f32, {out_rows, 3, k.c})
                           : dsa::make_view(r.stats.data(), DType::f32, {k.batch, out_rows / k.batch, 3, k.c});
    dsa::compressor_fwd(view2(kv, C), view2(gate, C), pb, p, view2(r.compressed, k.c), stats, backend);
    dsa::compressor_bwd(view2(grad_out, k.c), view2(kv, C), view2(gate, C), pb, stats, p, view2(r.grad_kv, C),
                        view2(r.grad_gate, C), grad_bias, backend);
    return r;
  }
};

float tolerance(DType d) { return d == DType::f32 ? 2e-5f : d == DType::bf16 ? 2e-2f : 4e-3f; }

void expect_close(const Buffer& a, const Buffer& b, float tol, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const float x = a.get(i), y = b.get(i);
    ASSERT_LE(std::fabs(x - y), tol * (1.0f + std::fabs(y))) << what << " at " << i << ": " << x << " vs " << y;
  }
}

void expect_outputs_close(const Outputs& fused, const Outputs& ref, DType dtype) {
  const float tol = tolerance(dtype);
  expect_close(fused.compressed, ref.compressed, tol, "compressed");
  expect_close(fused.grad_kv, ref.grad_kv, tol, "grad_kv");
  expect_close(fused.grad_gate, ref.grad_gate, tol, "grad_gate");
  for (std::size_t i = 0; i < ref.grad_bias.size(); ++i)
    ASSERT_NEAR(fused.grad_bias[i], ref.grad_bias[i], 2e-4f * (1.0f + std::fabs(ref.grad_bias[i]))) << "grad_bias " << i;
  ASSERT_EQ(fused.stats.size(), ref.stats.size());
  for (std::size_t i = 0; i < ref.stats.size(); ++i)  // max, 1 / sum, out in fp32
    ASSERT_NEAR(fused.stats[i], ref.stats[i], 2e-5f * (1.0f + std::fabs(ref.stats[i]))) << "stats " << i;
}

// The fused backend against the reference, with and without saved statistics.
void expect_matches_reference(const Case& cs) {
  Problem p(cs);
  expect_outputs_close(p.run(dsa::Backend::cpu), p.run(dsa::Backend::reference), cs.dtype);
  expect_outputs_close(p.run(dsa::Backend::cpu, 0, true), p.run(dsa::Backend::reference, 0, true), cs.dtype);
}

// Bit-identical outputs, gradients and statistics.
void expect_same_bits(const Outputs& a, const Outputs& b) {
  EXPECT_EQ(a.compressed.bits(), b.compressed.bits());
  EXPECT_EQ(a.grad_kv.bits(), b.grad_kv.bits());
  EXPECT_EQ(a.grad_gate.bits(), b.grad_gate.bits());
  EXPECT_EQ(a.grad_bias, b.grad_bias);
  EXPECT_EQ(a.stats, b.stats);
}

// The case with every tensor one element past a 64-byte boundary gives the
// same bits as the aligned case (so it matches the reference where that does),
// with and without saved statistics.
void expect_alignment_free(const Case& cs) {
  Case shifted = cs;
  shifted.shift = 1;
  Problem aligned(cs), unaligned(shifted);
  for (bool stats : {false, true})
    expect_same_bits(aligned.run(dsa::Backend::cpu, 0, stats), unaligned.run(dsa::Backend::cpu, 0, stats));
}

class CompressorIsa : public ::testing::TestWithParam<dsa::core::Isa> {
 protected:
  void SetUp() override {
    if (const std::string why = dsa_testing::skip_reason(GetParam()); !why.empty()) GTEST_SKIP() << why;
    dsa::core::limit_isa_for_testing(GetParam());
  }
  void TearDown() override { dsa::core::limit_isa_for_testing(dsa::core::Isa::amx); }
};

TEST_P(CompressorIsa, OverlapTndSeveralSequences) {
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    Case cs;
    cs.dtype = d;
    cs.lengths = {0, 1, 3, 4, 7, 8, 9, 33, 65};
    cs.c = 40;  // a full 16-lane vector plus a masked tail
    expect_matches_reference(cs);
  }
}

TEST_P(CompressorIsa, NonOverlapRatio128) {
  Case cs;
  cs.ratio = 128;
  cs.overlap = false;
  cs.c = 72;
  cs.lengths = {127, 128, 300};
  expect_matches_reference(cs);
  cs.dtype = DType::bf16;
  expect_matches_reference(cs);
}

TEST_P(CompressorIsa, HugeRatio) {
  Case cs;
  cs.ratio = 2048;  // 2048 slots per entry through the strip kernel's scratch
  cs.overlap = false;
  cs.c = 200;
  cs.lengths = {2047, 4100};
  cs.dtype = DType::bf16;
  expect_matches_reference(cs);
}

TEST_P(CompressorIsa, BsndPadding) {
  Case cs;
  cs.layout = dsa::Layout::BSND;
  cs.batch = 3;
  cs.rows = 19;
  cs.lengths = {19, 5, 2};
  cs.c = 17;
  expect_matches_reference(cs);
  cs.overlap = false;
  cs.ratio = 3;
  expect_matches_reference(cs);
}

TEST_P(CompressorIsa, WideChannelsManyGroups) {
  Case cs;
  cs.ratio = 4;
  cs.c = 300;  // 600-element rows: streamed gradient lines mix aligned and not
  cs.lengths = {4100, 37};
  cs.dtype = DType::bf16;
  expect_matches_reference(cs);
}

// Gradients of kStreamGradientBytes (4 MiB) and more are written with
// non-temporal stores; 64-byte aligned rows take that path for every line, in
// every dtype, with and without overlap. Tensors need only their element
// alignment: the same cases with every input and output one element past a
// 64-byte boundary take the masked heads and tails instead, and give the same
// bits. The threshold is lowered for these cases, so that small tensors take
// the streamed path (full-size ones took 6-10 s per ISA, far more under ASan);
// FullSizeGradientsAtTheRealThreshold below keeps one full-size case.
class StreamFromBytes {
 public:
  explicit StreamFromBytes(std::int64_t bytes) {
    dsa::cpu::compressor_kernels::stream_gradients_from_bytes_for_testing(bytes);
  }
  ~StreamFromBytes() {
    dsa::cpu::compressor_kernels::stream_gradients_from_bytes_for_testing(
        dsa::cpu::compressor_kernels::kStreamGradientBytes);
  }
};

TEST_P(CompressorIsa, StreamedGradientsAndUnalignedTensors) {
  const StreamFromBytes every_gradient(1);
  for (DType d : {DType::bf16, DType::f16, DType::f32}) {
    Case cs;
    cs.dtype = d;
    cs.c = 512;
    cs.lengths = {300, 101};
    expect_matches_reference(cs);
    expect_alignment_free(cs);
    cs.overlap = false;
    cs.ratio = 16;
    cs.c = 1024;
    expect_matches_reference(cs);
    expect_alignment_free(cs);
  }
}

TEST_P(CompressorIsa, DeterministicAcrossThreadCounts) {
  Case cs;
  cs.c = 200;
  cs.lengths = {5000, 3000};
  cs.dtype = DType::bf16;
  Problem p(cs);
  for (bool stats : {false, true}) {
    expect_same_bits(p.run(dsa::Backend::cpu, 1, stats), p.run(dsa::Backend::cpu, 3, stats));
  }
}

TEST_P(CompressorIsa, AllMinusInfChannelGivesZero) {
  Case cs;
  cs.ratio = 2;
  cs.overlap = false;
  cs.c = 20;
  cs.lengths = {6};
  Problem p(cs);
  for (std::int64_t j = 0; j < 2; ++j) p.bias[j * 20 + 3] = -INFINITY;  // channel 3: no finite logit
  for (auto [b, stats] : {std::pair{dsa::Backend::reference, false}, std::pair{dsa::Backend::cpu, false},
                           std::pair{dsa::Backend::cpu, true}}) {
    const Outputs r = p.run(b, 0, stats);
    for (std::int64_t w = 0; w < 3; ++w) {
      EXPECT_EQ(r.compressed.get(w * 20 + 3), 0.0f);
      EXPECT_TRUE(std::isfinite(r.compressed.get(w * 20 + 4)));
    }
    EXPECT_EQ(r.grad_bias[3], 0.0f);
    EXPECT_EQ(r.grad_gate.get(3), 0.0f);
  }
}

// NaN in the data reaches exactly the outputs it reaches in the reference
// (the vector kernels' bf16 rounding checks for NaN once per pair of vectors
// and only then mends those lanes), and every other element still matches.
void expect_same_nans(const Buffer& fused, const Buffer& ref, float tol, const char* what) {
  ASSERT_EQ(fused.size(), ref.size());
  std::size_t nans = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const float x = fused.get(i), y = ref.get(i);
    ASSERT_EQ(std::isnan(x), std::isnan(y)) << what << " at " << i << ": " << x << " vs " << y;
    if (std::isnan(y)) {
      ++nans;
    } else {
      ASSERT_LE(std::fabs(x - y), tol * (1.0f + std::fabs(y))) << what << " at " << i << ": " << x << " vs " << y;
    }
  }
  EXPECT_GT(nans, 0u) << what << ": the case puts NaN there";
}

TEST_P(CompressorIsa, NanReachesWhatItReachesInTheReference) {
  for (DType d : {DType::bf16, DType::f16, DType::f32})
    for (auto [ratio, overlap] : {std::pair<std::int64_t, bool>{16, false}, std::pair<std::int64_t, bool>{4, true}}) {
      Case cs;
      cs.dtype = d;
      cs.ratio = ratio;
      cs.overlap = overlap;
      cs.c = 40;  // one whole 32-channel group and a tail
      cs.lengths = {64};
      Problem p(cs);
      p.kv.set(5 * p.C + 7, NAN);                        // a value of token 5, channel 7
      p.grad_out.set(2 * cs.c + 33, std::nanf(""));      // the incoming gradient of entry 2, channel 33 (the tail)
      p.grad_out.set(3 * cs.c + 12, -std::nanf(""));     // and a negative NaN at entry 3, channel 12
      // fp32 NaNs whose low 16 bits are all ones, in the position bias: they
      // reach the bf16 gradients with that payload, where the plain rounding
      // sum would turn them into -0 and +0.
      p.bias[3 * p.C + 20] = std::bit_cast<float>(0x7fffffffu);
      p.bias[1 * p.C + 38] = std::bit_cast<float>(0xffffffffu);
      for (bool stats : {false, true}) {
        SCOPED_TRACE(std::string(dsa::dtype_name(d)) + " ratio " + std::to_string(ratio) + (stats ? " stats" : ""));
        const Outputs fused = p.run(dsa::Backend::cpu, 0, stats), ref = p.run(dsa::Backend::reference, 0, stats);
        const float tol = tolerance(d);
        expect_same_nans(fused.compressed, ref.compressed, tol, "compressed");
        expect_same_nans(fused.grad_kv, ref.grad_kv, tol, "grad_kv");
        expect_same_nans(fused.grad_gate, ref.grad_gate, tol, "grad_gate");
        for (std::size_t i = 0; i < ref.grad_bias.size(); ++i)
          ASSERT_EQ(std::isnan(fused.grad_bias[i]), std::isnan(ref.grad_bias[i])) << "grad_bias " << i;
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Isa, CompressorIsa,
                         ::testing::Values(dsa::core::Isa::portable, dsa::core::Isa::avx2, dsa::core::Isa::avx512,
                                           dsa::core::Isa::avx512_bf16, dsa::core::Isa::amx),
                         [](const auto& info) { return std::string(dsa::core::isa_name(info.param)); });

// Gradients past the real streaming threshold, on the best path the CPU has
// (the lowered threshold above runs every path's streamed stores).
TEST(Compressor, FullSizeGradientsAtTheRealThreshold) {
  Case cs;  // 3101 tokens x 1024 bf16 channels: 6.1 MiB per gradient
  cs.dtype = DType::bf16;
  cs.c = 512;
  cs.lengths = {2100, 1001};
  expect_matches_reference(cs);
}

TEST(Compressor, BadInputsThrowAndWriteNothing) {
  Case cs;
  cs.lengths = {8, 8};
  Problem p(cs);
  Buffer out(DType::f32, 4 * cs.c);
  for (std::size_t i = 0; i < out.size(); ++i) out.set(i, 5.0f);
  auto pb = dsa::make_view(p.bias.data(), DType::f32, {4, p.C});
  auto call = [&](dsa::CompressorParams params, dsa::TensorView bias) {
    dsa::compressor_fwd(p.view2(p.kv, p.C), p.view2(p.gate, p.C), bias, params, p.view2(out, cs.c));
  };
  auto expect_error = [&](auto&& f, const char* needle) {
    try {
      f();
      FAIL() << "expected an error mentioning " << needle;
    } catch (const dsa::Error& e) {
      EXPECT_EQ(e.kind(), dsa::ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  dsa::CompressorParams bad = p.params;
  bad.ratio = 0;
  expect_error([&] { call(bad, pb); }, "ratio");
  expect_error([&] { call(p.params, dsa::make_view(p.bias.data(), DType::f32, {2, p.C * 2})); }, "position_bias");
  bad = p.params;
  bad.cu_seqlens = {0, 8, 15};
  expect_error([&] { call(bad, pb); }, "query_lengths");
  bad.cu_seqlens = {0, 9, 8, 16};
  expect_error([&] { call(bad, pb); }, "query_lengths");
  Buffer wrong(DType::f32, 3 * cs.c);
  expect_error([&] {
    dsa::compressor_fwd(p.view2(p.kv, p.C), p.view2(p.gate, p.C), pb, p.params, p.view2(wrong, cs.c));
  }, "compressed");
  std::vector<float> stats(4 * 3 * cs.c);
  expect_error([&] {
    dsa::compressor_fwd(p.view2(p.kv, p.C), p.view2(p.gate, p.C), pb, p.params, p.view2(out, cs.c),
                        dsa::make_view(stats.data(), DType::f32, {4, 2, cs.c}));
  }, "stats");
  dsa::TensorView too_many = pb;  // a hand-made view claiming more dims than a view holds
  too_many.ndim = dsa::kMaxDims + 1;
  expect_error([&] { call(p.params, too_many); }, "position_bias");
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out.get(i), 5.0f);
  EXPECT_EQ(dsa::compressed_cu_seqlens({0, 3, 11, 20}, 4), (dsa::CuSeqlens{0, 0, 2, 4}));
}

// Found by fuzz_compressor (its corpus keeps the input as
// regression-numel-overflow-*): ratio = INT64_MAX with a position_bias of that
// many rows passed the shape checks, and counting its elements overflowed
// int64 (undefined behaviour; the wrapped count then read as "empty").
TEST(Compressor, PositionBiasWhoseElementCountOverflowsIsRejected) {
  std::uint16_t kv = 0, gate = 0, out = 0;
  float bias[4] = {};
  dsa::CompressorParams params;
  params.ratio = std::numeric_limits<std::int64_t>::max();
  dsa::TensorView huge_bias = dsa::make_view(bias, DType::f32, {2, 2});
  huge_bias.shape[0] = params.ratio;
  for (dsa::Backend backend : {dsa::Backend::reference, dsa::Backend::cpu}) {
    try {
      dsa::compressor_fwd(dsa::make_view(&kv, DType::bf16, {0, 2}), dsa::make_view(&gate, DType::bf16, {0, 2}),
                          huge_bias, params, dsa::make_view(&out, DType::bf16, {0, 2}), backend);
      ADD_FAILURE() << "accepted a position_bias of INT64_MAX x 2 elements";
    } catch (const dsa::Error& e) {
      EXPECT_EQ(e.kind(), dsa::ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("position_bias"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
