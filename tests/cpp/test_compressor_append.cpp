// The decode compressor (dsa/compressor_append.h): a prompt appended in one
// call, in chunks or one token at a time gives compressor_fwd's entries on the
// whole sequence (fp32: bit for bit, on every ISA path and the reference), the
// same bits for any thread count, and bad arguments are refused naming them.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "dsa/compressor.h"
#include "dsa/compressor_append.h"
#include "dsa/error.h"
#include "isa_paths.h"

namespace {

using dsa::DType;

struct Mode {
  std::int64_t ratio;
  bool overlap;
  std::int64_t c;
};

// Requests of different lengths, each with its kv / gate rows [length, C].
struct Requests {
  Mode mode;
  std::int64_t C;
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<float>> kv, gate;  // fp32 values (bf16-exact when asked)
  std::vector<float> bias;
  Requests(Mode m, std::vector<std::int64_t> lens, bool bf16_values, unsigned seed)
      : mode(m), C((m.overlap ? 2 : 1) * m.c), lengths(std::move(lens)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto draw = [&] {
      const float v = normal(rng);
      return bf16_values ? dsa::core::bf16_to_float(dsa::core::float_to_bf16(v)) : v;
    };
    for (std::int64_t L : lengths) {
      kv.emplace_back(L * C);
      gate.emplace_back(L * C);
      for (auto& v : kv.back()) v = draw();
      for (auto& v : gate.back()) v = 2.0f * draw();
      // A -inf gate or two: a channel of a slot that never contributes.
      if (L * C > 5) gate.back()[5] = -INFINITY;
    }
    bias.resize(m.ratio * C);
    for (auto& v : bias) v = 0.5f * normal(rng);
  }
};

std::vector<std::uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = dsa::core::float_to_bf16(v[i]);
  return out;
}

// compressor_fwd on each whole request: entries [L // m][c] per request, as fp32 bits.
std::vector<std::vector<float>> one_shot(const Requests& r, DType dtype, dsa::Backend backend) {
  std::vector<std::vector<float>> out;
  for (std::size_t b = 0; b < r.lengths.size(); ++b) {
    const std::int64_t L = r.lengths[b], E = L / r.mode.ratio, c = r.mode.c;
    dsa::CompressorParams params;
    params.ratio = r.mode.ratio;
    params.overlap = r.mode.overlap;
    params.num_threads = 1;
    std::vector<float> entries(E * c);
    if (dtype == DType::f32) {
      dsa::compressor_fwd(dsa::make_view(const_cast<float*>(r.kv[b].data()), DType::f32, {L, r.C}),
                          dsa::make_view(const_cast<float*>(r.gate[b].data()), DType::f32, {L, r.C}),
                          dsa::make_view(const_cast<float*>(r.bias.data()), DType::f32, {r.mode.ratio, r.C}), params,
                          dsa::make_view(entries.data(), DType::f32, {E, c}), backend);
    } else {
      auto kv = to_bf16(r.kv[b]), gate = to_bf16(r.gate[b]);
      std::vector<std::uint16_t> half(E * c);
      dsa::compressor_fwd(dsa::make_view(kv.data(), DType::bf16, {L, r.C}),
                          dsa::make_view(gate.data(), DType::bf16, {L, r.C}),
                          dsa::make_view(const_cast<float*>(r.bias.data()), DType::f32, {r.mode.ratio, r.C}), params,
                          dsa::make_view(half.data(), DType::bf16, {E, c}), backend);
      for (std::int64_t i = 0; i < E * c; ++i) entries[i] = dsa::core::bf16_to_float(half[i]);
    }
    out.push_back(std::move(entries));
  }
  return out;
}

// The same requests appended as a batch in steps of `chunk` tokens (each request
// its own count per step: new_lens), collecting every entry.
std::vector<std::vector<float>> appended(const Requests& r, DType dtype, std::int64_t chunk, dsa::Backend backend,
                                         int threads) {
  const std::int64_t B = static_cast<std::int64_t>(r.lengths.size()), m = r.mode.ratio, c = r.mode.c;
  const std::int64_t R = dsa::compressor_state_rows(m, r.mode.overlap);
  std::vector<float> state_kv(B * R * r.C, 7.0f), state_gate(B * R * r.C, 7.0f);  // garbage: a fresh state is any
  std::vector<std::int64_t> lengths(B, 0);
  std::vector<std::vector<float>> out(B);
  std::int64_t longest = 0;
  for (auto L : r.lengths) longest = std::max(longest, L);
  for (std::int64_t done = 0; done < longest; done += chunk) {
    const std::int64_t n = std::min(chunk, longest - done), E = (n + m - 1) / m;
    std::vector<float> kv(B * n * r.C, 0.0f), gate(B * n * r.C, 0.0f);
    std::vector<std::int64_t> new_lens(B);
    for (std::int64_t b = 0; b < B; ++b) {
      new_lens[b] = std::clamp<std::int64_t>(r.lengths[b] - done, 0, n);
      for (std::int64_t i = 0; i < new_lens[b] * r.C; ++i) {
        kv[b * n * r.C + i] = r.kv[b][done * r.C + i];
        gate[b * n * r.C + i] = r.gate[b][done * r.C + i];
      }
    }
    std::vector<float> entries(B * E * c, 9.0f);
    std::vector<std::uint16_t> kv16 = to_bf16(kv), gate16 = to_bf16(gate), entries16(B * E * c, 1);
    const bool f32 = dtype == DType::f32;
    dsa::CompressorAppendParams params;
    params.ratio = m;
    params.overlap = r.mode.overlap;
    params.num_threads = threads;
    dsa::compressor_append(
        f32 ? dsa::make_view(kv.data(), dtype, {B, n, r.C}) : dsa::make_view(kv16.data(), dtype, {B, n, r.C}),
        f32 ? dsa::make_view(gate.data(), dtype, {B, n, r.C}) : dsa::make_view(gate16.data(), dtype, {B, n, r.C}),
        dsa::make_view(const_cast<float*>(r.bias.data()), DType::f32, {m, r.C}),
        dsa::make_view(state_kv.data(), DType::f32, {B, R, r.C}),
        dsa::make_view(state_gate.data(), DType::f32, {B, R, r.C}),
        dsa::make_view(lengths.data(), DType::i64, {B}), dsa::make_view(new_lens.data(), DType::i64, {B}), params,
        f32 ? dsa::make_view(entries.data(), dtype, {B, E, c}) : dsa::make_view(entries16.data(), dtype, {B, E, c}),
        backend);
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t count = (lengths[b] + new_lens[b]) / m - lengths[b] / m;
      for (std::int64_t e = 0; e < E; ++e)
        for (std::int64_t ch = 0; ch < c; ++ch) {
          const std::int64_t i = (b * E + e) * c + ch;
          const float v = f32 ? entries[i] : dsa::core::bf16_to_float(entries16[i]);
          if (e < count) out[b].push_back(v);
          else EXPECT_EQ(v, 0.0f) << "row past the request's entries";
        }
      lengths[b] += new_lens[b];
    }
  }
  return out;
}

void expect_same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t r = 0; r < a.size(); ++r) {
    ASSERT_EQ(a[r].size(), b[r].size()) << "request " << r;
    for (std::size_t i = 0; i < a[r].size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(a[r][i]), std::bit_cast<std::uint32_t>(b[r][i]))
          << "request " << r << " element " << i << ": " << a[r][i] << " vs " << b[r][i];
  }
}

const Mode kModes[] = {{4, true, 24}, {4, false, 40}, {8, true, 17}, {16, false, 33}, {1, true, 8}};

TEST(CompressorAppend, Fp32AnyChunkingEqualsTheOneShotCompressorBitForBit) {
  for (const Mode& mode : kModes) {
    const Requests r(mode, {0, 1, 2 * mode.ratio - 1, 5 * mode.ratio + 3, 7 * mode.ratio}, false, 11);
    for (dsa::core::Isa isa : dsa_testing::distinct_paths()) {
      dsa_testing::IsaLimit limit(isa);
      SCOPED_TRACE(std::string(dsa::core::isa_name(isa)) + " ratio " + std::to_string(mode.ratio) +
                   (mode.overlap ? " overlap" : ""));
      const auto expected = one_shot(r, DType::f32, dsa::Backend::cpu);
      for (std::int64_t chunk : {std::int64_t{1}, std::int64_t{3}, mode.ratio, std::int64_t{1000}})
        for (int threads : {1, 2}) {
          SCOPED_TRACE("chunk " + std::to_string(chunk) + " threads " + std::to_string(threads));
          expect_same_bits(appended(r, DType::f32, chunk, dsa::Backend::cpu, threads), expected);
        }
    }
    SCOPED_TRACE("reference");
    expect_same_bits(appended(r, DType::f32, 1, dsa::Backend::reference, 1),
                     one_shot(r, DType::f32, dsa::Backend::reference));
    expect_same_bits(appended(r, DType::f32, 5, dsa::Backend::reference, 1),
                     one_shot(r, DType::f32, dsa::Backend::reference));
  }
}

TEST(CompressorAppend, Bf16MatchesTheOneShotCompressorAndThreadCountsAgree) {
  for (const Mode& mode : kModes) {
    const Requests r(mode, {3 * mode.ratio + 1, 6 * mode.ratio}, true, 12);
    for (dsa::core::Isa isa : dsa_testing::distinct_paths()) {
      dsa_testing::IsaLimit limit(isa);
      SCOPED_TRACE(std::string(dsa::core::isa_name(isa)) + " ratio " + std::to_string(mode.ratio));
      const auto expected = one_shot(r, DType::f32, dsa::Backend::reference);  // bf16-exact inputs, fp32 out
      for (std::int64_t chunk : {std::int64_t{1}, std::int64_t{2} * mode.ratio + 1}) {
        const auto one = appended(r, DType::bf16, chunk, dsa::Backend::cpu, 1);
        expect_same_bits(appended(r, DType::bf16, chunk, dsa::Backend::cpu, 2), one);
        for (std::size_t b = 0; b < one.size(); ++b)
          for (std::size_t i = 0; i < one[b].size(); ++i)  // one bf16 rounding of the fp32 result
            EXPECT_NEAR(one[b][i], expected[b][i], std::fabs(expected[b][i]) * 0x1p-8f + 1e-6f) << b << " " << i;
      }
      // Whole-prompt entries that pool only new rows are compressor_fwd's bf16 bits.
      expect_same_bits(appended(r, DType::bf16, 1000, dsa::Backend::cpu, 1), one_shot(r, DType::bf16, dsa::Backend::cpu));
    }
  }
}

TEST(CompressorAppend, BadArgumentsAreRefusedNamingThem) {
  const std::int64_t B = 2, n = 3, m = 4, c = 8, C = 16, R = 8;
  std::vector<float> kv(B * n * C), gate(B * n * C), bias(m * C), skv(B * R * C), sgate(B * R * C), out(B * 1 * c);
  std::vector<std::int32_t> lens{0, 5}, new_lens{3, 2};
  dsa::CompressorAppendParams params;
  params.ratio = m;
  auto view = [](auto& v, DType t, std::initializer_list<std::int64_t> s) { return dsa::make_view(v.data(), t, s); };
  struct Args {
    dsa::TensorView kv, gate, bias, skv, sgate, lens, new_lens, out;
    dsa::CompressorAppendParams params;
  };
  const Args good{view(kv, DType::f32, {B, n, C}), view(gate, DType::f32, {B, n, C}), view(bias, DType::f32, {m, C}),
                  view(skv, DType::f32, {B, R, C}), view(sgate, DType::f32, {B, R, C}), view(lens, DType::i32, {B}),
                  view(new_lens, DType::i32, {B}), view(out, DType::f32, {B, 1, c}), params};
  auto run = [](const Args& a) {
    dsa::compressor_append(a.kv, a.gate, a.bias, a.skv, a.sgate, a.lens, a.new_lens, a.params, a.out);
  };
  EXPECT_NO_THROW(run(good));
  auto expect_error = [&](Args a, const char* needle) {
    try {
      run(a);
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const dsa::Error& e) {
      EXPECT_EQ(e.kind(), dsa::ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  Args a = good;
  a.params.ratio = 0;
  expect_error(a, "ratio");
  a = good;
  a.skv = view(skv, DType::f32, {B, 4, C});  // the ring of a non-overlapping state
  expect_error(a, "state_kv");
  a = good;
  a.sgate = a.skv;
  expect_error(a, "state_gate");
  a = good;
  a.out = view(out, DType::f32, {B, 2, c});
  expect_error(a, "compressed");
  std::vector<std::int32_t> negative{0, -1}, too_many{4, 0};
  a = good;
  a.lens = view(negative, DType::i32, {B});
  expect_error(a, "lengths");
  a = good;
  a.new_lens = view(too_many, DType::i32, {B});
  expect_error(a, "new_lens");
  a = good;
  a.gate = view(gate, DType::f32, {B, n - 1, C});
  expect_error(a, "gate");
  a = good;
  a.kv = view(kv, DType::f32, {B, n, 15});
  a.gate = view(gate, DType::f32, {B, n, 15});
  expect_error(a, "kv");
}

}  // namespace
