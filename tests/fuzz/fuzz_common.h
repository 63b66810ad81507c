// Shared decoding for the libFuzzer targets (tests/fuzz/fuzz_<op>.cpp).
//
// A target turns the fuzzer's bytes into tensor views, parameters and length
// arrays, calls an op family forward and backward on every backend, and
// requires "either a dsa::Error or a result": any other exception, a crash, a
// sanitizer report or a hang is a finding.
//
// Decoding is biased so that running out of bytes (FuzzedDataProvider then
// returns 0 / false) gives the plain, valid case: every oddity costs bytes.
// Buffers are allocated to exactly the extent their view addresses (plus a
// leading element offset for misalignment), so ASan flags the first byte a
// kernel reads or writes outside a view.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "dsa/backend.h"
#include "dsa/error.h"
#include "dsa/layout.h"
#include "dsa/tensor.h"

namespace dsa_fuzz {

using dsa::DType;
using dsa::TensorView;

// Whole bytes one input may allocate across its tensors: keeps a single input
// from paging in GiBs (libFuzzer's -rss_limit_mb would call that a finding).
inline constexpr std::int64_t kMaxInputBytes = 16 << 20;

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : fdp_(data, size) {}

  // True about once in `n` draws; false when the bytes are exhausted.
  bool rare(int n) { return fdp_.ConsumeIntegralInRange<int>(0, n - 1) == n - 1; }
  bool flag() { return fdp_.ConsumeBool(); }
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    return fdp_.ConsumeIntegralInRange<std::int64_t>(lo, hi);
  }
  std::uint64_t u64() { return fdp_.ConsumeIntegral<std::uint64_t>(); }
  template <class T>
  T pick(std::initializer_list<T> values) {
    return *(values.begin() + range(0, static_cast<std::int64_t>(values.size()) - 1));
  }

  // A size: mostly small (odd and tile-edge sizes are all reachable), now and
  // then up to `hi`, rarely a value no tensor can have.
  std::int64_t size(std::int64_t small, std::int64_t hi) {
    if (rare(64)) return pick<std::int64_t>({-1, -7, std::numeric_limits<std::int64_t>::min(),
                                             std::numeric_limits<std::int64_t>::max(), 1ll << 40});
    return rare(4) ? range(0, hi) : range(1, small);
  }

  // An integer parameter (topk, ratio, window, d_v): `usual` unless the input
  // spends bytes on another value, possibly negative or huge.
  std::int64_t param(std::int64_t usual, std::int64_t hi) {
    if (!rare(4)) return usual;
    if (rare(8)) return pick<std::int64_t>({0, -1, std::numeric_limits<std::int64_t>::min(),
                                            std::numeric_limits<std::int64_t>::max(), 1ll << 33});
    return range(0, hi);
  }

  // A float parameter (scales, coefficients, grad_loss), now and then NaN / inf / extreme.
  float real(float usual) {
    if (!rare(4)) return usual;
    return pick<float>({0.0f, -1.0f, 1e-30f, 1e30f, std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::denorm_min(), 0.125f, 3.0f});
  }

  // The dtype an argument should have, now and then any other one.
  DType dtype(DType want) {
    if (!rare(24)) return want;
    return pick<DType>({DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64});
  }
  DType float_dtype() { return pick<DType>({DType::bf16, DType::f32, DType::f16}); }

  int num_threads() { return rare(4) ? static_cast<int>(pick<std::int64_t>({1, 2, 3, -1, 5})) : 0; }

  dsa::Layout layout() { return flag() ? dsa::Layout::BSND : dsa::Layout::TND; }

  FuzzedDataProvider& provider() { return fdp_; }

 private:
  FuzzedDataProvider fdp_;
};

// splitmix64: the fill of every buffer follows from one seed the input chose.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * static_cast<float>(next() >> 40) * 0x1p-24f; }

 private:
  std::uint64_t state_;
};

inline std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp32 -> IEEE half, truncating the mantissa (the values are test data, not
// results, so rounding does not matter); overflow -> inf, tiny -> signed zero.
inline std::uint16_t to_f16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return 0x7e00;
  const int exponent = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  if (exponent >= 31) return sign | 0x7c00;
  if (exponent <= 0) return sign;
  return static_cast<std::uint16_t>(sign | (exponent << 10) | ((u >> 13) & 0x3ff));
}

inline dsa::CuSeqlens cumulative(const std::vector<std::int64_t>& lengths) {
  dsa::CuSeqlens cu{0};
  for (auto l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

// How a float buffer is filled: plain values in [-range, range], and in
// `special` mode also NaN, +-inf, huge and zero at some positions.
struct FloatFill {
  float range = 2.0f;
  bool special = false;
  bool non_negative = false;  // e.g. softmax sums
};

// Owns every buffer of one input; views point into it.
class Arena {
 public:
  explicit Arena(Input& in) : in_(in), rng_(in.u64()) {}

  // A view of `shape` (ndim = shape.size()) and `dtype`. The input may change
  // the strides (padded, overlapping or zero, or so large that the extent
  // overflows int64), the rank (one dim dropped or added), the device, or
  // make the view absent. Returns false when the view is valid but addresses
  // more than this input may allocate: the caller then skips the input.
  bool view(TensorView& v, DType dtype, std::vector<std::int64_t> shape) {
    v = TensorView{};
    v.dtype = dtype;
    if (in_.rare(48)) return true;  // absent
    if (in_.rare(48)) {
      if (in_.flag() && !shape.empty()) shape.pop_back();
      else shape.insert(shape.begin() + in_.range(0, static_cast<std::int64_t>(shape.size())), in_.range(0, 3));
    }
    if (shape.size() > static_cast<std::size_t>(dsa::kMaxDims)) shape.resize(dsa::kMaxDims);
    v.ndim = static_cast<int>(shape.size());
    for (int d = 0; d < v.ndim; ++d) v.shape[d] = shape[d];
    if (in_.rare(64)) v.device = dsa::Device::cuda;

    // Strides in elements: contiguous unless the input asks otherwise. Sizes
    // from 2^32 up get no zero or overlapping strides: with them a view of a
    // few elements could claim work no run can do (the library has no
    // resource limit of its own), and the harness could not bound it.
    int mode = in_.rare(6) ? static_cast<int>(in_.range(1, 4)) : 0;
    for (int d = 0; d < v.ndim; ++d)
      if (mode >= 2 && shape[d] >= (1ll << 32)) mode = 0;
    std::int64_t expected = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      std::int64_t stride = expected;
      // Saturating: `expected` may be up to INT64_MAX (a huge dim times 1), and an
      // overflow here would be the harness's own undefined behaviour.
      auto sat_add = [](std::int64_t a, std::int64_t b) {
        std::int64_t r;
        return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<std::int64_t>::max() : r;
      };
      if (mode == 1) stride = sat_add(expected, in_.range(0, 9));                     // padded rows
      if (mode == 2 && d < v.ndim - 1) stride = in_.range(0, expected);              // overlapping / zero
      if (mode == 3 && in_.rare(2)) stride = in_.range(0, 3) == 0 ? 0 : 1ll << in_.range(55, 62);
      if (mode == 4) stride = in_.range(0, sat_add(sat_add(expected, expected), 2));  // anything small, last dim too
      v.strides[d] = stride;
      std::int64_t dim = shape[d] > 0 ? shape[d] : 1;
      if (__builtin_mul_overflow(expected, dim, &expected)) expected = std::numeric_limits<std::int64_t>::max() / 4;
    }
    return place(v);
  }

  // A gradient or output shaped like `input` in its dtype (with view()'s
  // mutations); absent when `input` is.
  bool like(TensorView& v, const TensorView& input) {
    v = TensorView{};
    if (!input.present() || input.ndim > dsa::kMaxDims) return true;
    return view(v, in_.dtype(input.dtype), std::vector<std::int64_t>(input.shape, input.shape + input.ndim));
  }

  // Fills a view's addressed elements (floating dtypes only; others stay as allocated).
  void fill(const TensorView& v, const FloatFill& f) {
    const std::int64_t n = elements(v);
    if (n <= 0 || !v.data) return;
    for (std::int64_t i = 0; i < n; ++i) {
      float x = rng_.uniform(f.non_negative ? 0.0f : -f.range, f.range);
      if (f.special && (rng_.next() & 15) == 0) {
        const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                  -std::numeric_limits<float>::infinity(), 0.0f, -0.0f, 3e38f, -3e38f, 1e-40f};
        x = specials[rng_.next() % 8];
      }
      store(v, i, x);
    }
  }

  // Fills a byte view (a paged cache) with random bytes: FP8 records with any
  // codes, NaN codes and scales included.
  void fill_bytes(const TensorView& v) {
    const std::int64_t n = elements(v);
    if (n <= 0 || !v.data || v.dtype != DType::u8) return;
    auto* p = static_cast<std::uint8_t*>(v.data);
    for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<std::uint8_t>(rng_.next());
  }

  // Fills an int32 view with indices: mostly in [-2, bound + 1], sometimes anything.
  void fill_indices(const TensorView& v, std::int64_t bound, bool wild) {
    const std::int64_t n = elements(v);
    if (n <= 0 || !v.data || v.dtype != DType::i32) return;
    auto* p = static_cast<std::int32_t*>(v.data);
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t x = static_cast<std::int64_t>(rng_.next() % static_cast<std::uint64_t>(bound + 4)) - 2;
      if (wild && (rng_.next() & 7) == 0) x = static_cast<std::int32_t>(rng_.next());
      p[i] = static_cast<std::int32_t>(x);
    }
  }

  Input& input() { return in_; }

  // Elements a view addresses (see elements below), for helpers outside.
  static std::int64_t addressed(const TensorView& v) { return elements(v); }

 private:
  // Elements between the view's first and last addressed element, inclusive;
  // -1 when that, or its size in bytes, overflows int64 (the library must
  // reject such a view).
  static std::int64_t elements(const TensorView& v) {
    if (!v.present()) return 0;
    std::int64_t last = 0, bytes = 0;
    for (int d = 0; d < v.ndim; ++d) {
      if (v.shape[d] <= 0) return 0;  // nothing addressed (or a shape the library must reject)
      std::int64_t span;
      if (__builtin_mul_overflow(v.shape[d] - 1, v.strides[d], &span) ||
          __builtin_add_overflow(last, span, &last))
        return -1;
    }
    // (last + 1 itself overflows at INT64_MAX: a [2, 1] view with stride 2^63 - 1,
    // fuzz_compressor 2026-12-06.)
    if (last == std::numeric_limits<std::int64_t>::max() ||
        __builtin_mul_overflow(last + 1, static_cast<std::int64_t>(dsa::dtype_size(v.dtype)), &bytes))
      return -1;
    return last + 1;
  }

  bool place(TensorView& v) {
    // DSA_FUZZ_VERBOSE=1 lists the views of each input (to turn a finding into a test).
    static const bool verbose = std::getenv("DSA_FUZZ_VERBOSE") != nullptr;
    if (verbose) {
      std::fprintf(stderr, "view %zu: %s%s shape [", buffers_.size(), dsa::dtype_name(v.dtype),
                   v.device == dsa::Device::cuda ? " cuda" : "");
      auto list = [&](const std::int64_t* values) {
        for (int d = 0; d < v.ndim; ++d) std::fprintf(stderr, "%s%lld", d ? ", " : "", static_cast<long long>(values[d]));
      };
      list(v.shape);
      std::fprintf(stderr, "] strides [");
      list(v.strides);
      std::fprintf(stderr, "]\n");
    }
    const std::int64_t n = elements(v);
    const std::int64_t esize = static_cast<std::int64_t>(dsa::dtype_size(v.dtype));
    // An overflowing extent gets a small real buffer: only the library's
    // validation may look at it, and any access beyond it is an ASan report.
    // (A count above what an input may allocate is only compared, never multiplied:
    // n * esize plus the offset overflowed for n near INT64_MAX, fuzz_decode 2026-12-06.)
    const std::int64_t bytes = n < 0 ? 64 : (n > kMaxInputBytes / esize ? kMaxInputBytes + 1 : n * esize);
    const std::int64_t offset = in_.rare(8) ? 1 : 0;  // element-aligned, not vector-aligned
    if (bytes + offset * esize > kMaxInputBytes - used_) return false;
    used_ += bytes + offset * esize;
    buffers_.emplace_back(new std::uint8_t[bytes + offset * esize]);
    v.data = buffers_.back().get() + offset * esize;
    std::memset(v.data, 0, bytes);
    return true;
  }

  static double to_int(float x, float limit) {
    if (!(x == x)) return 0.0;  // NaN
    return static_cast<double>(std::max(-limit, std::min(limit, x)));
  }
  static void store(const TensorView& v, std::int64_t i, float x) {
    switch (v.dtype) {
      case DType::f32: static_cast<float*>(v.data)[i] = x; break;
      case DType::bf16: static_cast<std::uint16_t*>(v.data)[i] = to_bf16(x); break;
      case DType::f16: static_cast<std::uint16_t*>(v.data)[i] = to_f16(x); break;
      // Integer views get the float clamped first: converting inf, NaN or an
      // out-of-range value would be the harness's own undefined behaviour.
      case DType::i32: static_cast<std::int32_t*>(v.data)[i] = static_cast<std::int32_t>(to_int(x, 2.0e9f)); break;
      case DType::i64: static_cast<std::int64_t*>(v.data)[i] = static_cast<std::int64_t>(to_int(x, 9.0e18f)); break;
      case DType::u8: static_cast<std::uint8_t*>(v.data)[i] = static_cast<std::uint8_t>(to_int(x, 255.0f)); break;
    }
  }

  Input& in_;
  Rng rng_;
  std::int64_t used_ = 0;
  std::vector<std::unique_ptr<std::uint8_t[]>> buffers_;
};

// Sequences of an input: lengths generated valid (Lq <= Lk per sequence), the
// tensor extents they imply, and the cu_seqlens the op gets, which the input
// may then break (see corrupt) or leave empty (the op's default).
struct Sequences {
  dsa::Layout layout = dsa::Layout::TND;
  bool tnd = true;
  std::int64_t batch = 1;
  std::int64_t q_rows = 0;  // TND: T; BSND: Sq
  std::int64_t k_rows = 0;  // raw keys: TND: S; BSND: Sk
  std::int64_t c_rows = 0;  // compressed entries at `ratio`: TND: S'; BSND: Sk'
  dsa::CuSeqlens cu_q, cu_k;
  std::vector<std::int64_t> lq, lk;  // the lengths drawn, before any corruption
  std::int64_t ratio = 1;
  double pairs = 0;  // sum of Lq * Lk: the work of a dense call

  // The leading dims of a token-major tensor with `rows` rows: [rows] or [B, rows].
  std::vector<std::int64_t> rows(std::int64_t rows, std::initializer_list<std::int64_t> rest) const {
    std::vector<std::int64_t> shape;
    if (!tnd) shape.push_back(batch);
    shape.push_back(rows);
    shape.insert(shape.end(), rest.begin(), rest.end());
    return shape;
  }
};

// Folds each drawn sequence's query rows of an index tensor [rows, K] or
// [B, rows, K] into [-1, its keys) (compressed entries when `compressed`): the
// ops refuse a position outside the query's sequence, so inputs that are to
// reach the kernels need this. Other rows keep what fill_indices wrote.
inline void fold_indices(const dsa::TensorView& v, const Sequences& seq, bool compressed) {
  if (Arena::addressed(v) <= 0 || v.dtype != DType::i32 || v.ndim < 2) return;
  auto* p = static_cast<std::int32_t*>(v.data);
  const int lead = seq.tnd ? 0 : 1;
  if (v.ndim < lead + 2) return;
  const std::int64_t rows = v.shape[lead], topk = v.shape[v.ndim - 1], ks = v.strides[v.ndim - 1];
  std::int64_t first = 0;
  for (std::size_t b = 0; b < seq.lq.size(); ++b) {
    const std::int64_t held = compressed ? seq.lk[b] / seq.ratio : seq.lk[b];
    const std::int64_t base = seq.tnd ? 0 : static_cast<std::int64_t>(b);
    if (!seq.tnd && base >= v.shape[0]) break;
    for (std::int64_t i = 0; i < seq.lq[b]; ++i) {
      const std::int64_t row = seq.tnd ? first + i : i;
      if (row >= rows) break;
      std::int32_t* r = p + row * v.strides[lead] + (seq.tnd ? 0 : base * v.strides[0]);
      for (std::int64_t k = 0; k < topk; ++k) {
        std::int32_t& x = r[k * ks];
        x = static_cast<std::int32_t>(((static_cast<std::int64_t>(x) + 1) % (held + 1) + held + 1) % (held + 1) - 1);
      }
    }
    first += seq.lq[b];
  }
}


// A broken length array: cleared (the op's default), an entry dropped or
// added, or one entry replaced (non-monotone, negative, past the tensor, extreme).
inline void corrupt(Input& in, dsa::CuSeqlens& cu) {
  if (!in.rare(12)) return;
  switch (in.range(0, 4)) {
    case 0: cu.clear(); break;
    case 1: if (!cu.empty()) cu.pop_back(); break;
    case 2: cu.push_back(cu.empty() ? 1 : cu.back() + in.range(-3, 3)); break;
    default:
      if (!cu.empty())
        cu[in.range(0, static_cast<std::int64_t>(cu.size()) - 1)] =
            in.pick<std::int64_t>({-1, 1, std::numeric_limits<std::int64_t>::max(),
                                   std::numeric_limits<std::int64_t>::min(), in.range(-5, 300)});
  }
}

// `max_q` queries and `max_extra` more keys per sequence at most (with
// compressed keys enough more for a few whole blocks); `ratio` (< 1 counts as
// 1) sizes the compressed extent. `self` makes Lk = Lq (the compressor's tokens).
inline Sequences sequences(Input& in, std::int64_t ratio, std::int64_t max_q, std::int64_t max_extra,
                           bool self = false) {
  ratio = std::max<std::int64_t>(ratio, 1);
  if (ratio > 1) max_extra = std::max(max_extra, 2 * std::min<std::int64_t>(ratio, 128) + 4);
  Sequences s;
  s.layout = in.layout();
  s.tnd = s.layout == dsa::Layout::TND;
  s.batch = in.range(1, s.tnd ? 4 : 3);
  std::vector<std::int64_t> lq(s.batch), lk(s.batch);
  std::int64_t max_lq = 0, max_lk = 0, cmp_total = 0, max_c = 0;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    lq[b] = in.rare(6) ? in.range(0, 2) : in.range(0, max_q);
    lk[b] = self ? lq[b] : lq[b] + in.range(0, max_extra);
    max_lq = std::max(max_lq, lq[b]);
    max_lk = std::max(max_lk, lk[b]);
    const std::int64_t c = dsa::compressed_length(lk[b], ratio);
    cmp_total += c;
    max_c = std::max(max_c, c);
    s.pairs += static_cast<double>(lq[b]) * static_cast<double>(lk[b]);
  }
  if (s.tnd) {
    s.q_rows = std::accumulate(lq.begin(), lq.end(), std::int64_t{0});
    s.k_rows = std::accumulate(lk.begin(), lk.end(), std::int64_t{0});
    s.c_rows = cmp_total;
  } else {
    // BSND rows hold up to their tensor's extent; padding is allowed.
    s.q_rows = max_lq + (in.rare(3) ? in.range(0, 3) : 0);
    s.k_rows = self ? s.q_rows : max_lk + (in.rare(3) ? in.range(0, 3) : 0);
    s.c_rows = max_c + (in.rare(3) ? in.range(0, 2) : 0);
  }
  if (in.rare(16)) s.q_rows += in.range(-1, 1);  // a tensor that disagrees with its lengths
  if (in.rare(16)) s.k_rows += in.range(-1, 1);
  if (in.rare(16)) s.c_rows += in.range(-1, 1);
  s.lq = lq;
  s.lk = lk;
  s.ratio = ratio;
  if (!in.rare(6)) {  // else: both empty, the op's defaults
    s.cu_q = cumulative(lq);
    s.cu_k = cumulative(lk);
  }
  corrupt(in, s.cu_q);
  corrupt(in, s.cu_k);
  return s;
}

// A cmp_ratio: mostly 1, 4 (CSA) or 128 (HCA), now and then anything.
inline std::int64_t cmp_ratio(Input& in) { return in.param(in.pick<std::int64_t>({1, 4, 1, 128, 2, 3}), 300); }

// The layout and length arrays of an op's params, from `seq`.
template <class Params>
void set_lengths(Params& params, const Sequences& seq) {
  params.layout = seq.layout;
  params.cu_seqlens_q = seq.cu_q;
  params.cu_seqlens_k = seq.cu_k;
}

// The backends every input runs on, and a way to try an out-of-range one.
inline std::vector<dsa::Backend> backends(Input& in) {
  if (in.rare(32)) return {in.pick<dsa::Backend>({dsa::Backend::cuda, dsa::Backend::automatic,
                                                  static_cast<dsa::Backend>(9)})};
  return {dsa::Backend::reference, dsa::Backend::cpu};
}

// The ISA level the fused backend may use for this input (capped at what the CPU has).
inline void choose_isa(Input& in) {
  using dsa::core::Isa;
  dsa::core::limit_isa_for_testing(
      in.pick<Isa>({Isa::amx, Isa::avx512_bf16, Isa::avx512, Isa::avx2, Isa::portable}));
}

// Runs one call: true when it completed, false on a dsa::Error saying the
// input breaks the contract or the backend cannot run it. Anything else is a
// finding: ErrorKind::internal (dsa's own bug) aborts here, and any other
// exception escapes to libFuzzer, which reports it as a crash.
template <class Call>
bool attempt(Call&& call, bool* invalid = nullptr) {
  try {
    call();
    return true;
  } catch (const dsa::Error& e) {
    if (e.kind() == dsa::ErrorKind::internal) {
      std::fprintf(stderr, "dsa::Error of kind internal: %s\n", e.what());
      std::abort();
    }
    if (invalid) *invalid = e.kind() == dsa::ErrorKind::invalid_argument;
    return false;
  }
}

// Calls that completed and calls rejected with a dsa::Error over the whole
// run, printed at exit under DSA_FUZZ_STATS=1: a harness whose inputs almost
// never complete fuzzes only the validation.
struct Outcomes {
  long completed = 0, rejected = 0;
  Outcomes() {
    if (std::getenv("DSA_FUZZ_STATS"))
      std::atexit([] {
        std::fprintf(stderr, "dsa fuzz: %ld calls completed, %ld rejected with dsa::Error\n", outcomes().completed,
                     outcomes().rejected);
      });
  }
  static Outcomes& outcomes() {
    static Outcomes o;
    return o;
  }
};

// The backends share the validation, so one that completes an input another
// rejects as invalid_argument is a finding (unsupported may differ).
class Agreement {
 public:
  explicit Agreement(const char* what) : what_(what) {}
  template <class Call>
  bool run(Call&& call) {
    bool invalid = false;
    const bool ok = attempt(call, &invalid);
    ++(ok ? Outcomes::outcomes().completed : Outcomes::outcomes().rejected);
    completed_ |= ok;
    rejected_ |= invalid;
    if (completed_ && rejected_) {
      std::fprintf(stderr, "%s: one backend completed an input another rejected as invalid\n", what_);
      std::abort();
    }
    return ok;
  }

 private:
  const char* what_;
  bool completed_ = false, rejected_ = false;
};

// Multiply-adds of a call, to skip inputs too slow for a fuzzing loop (the
// reference backend is quadratic), as a product of factors built from sizes
// with plain(). A zero size means no work, so such an input always runs
// (empty tensors with huge other sizes found real bugs). Sizes no tensor with
// elements can have (negative, 2^32 and up: view() gives such views no zero or
// overlapping strides, so their extent overflows) count as 1: the library
// must reject them before any work, and skipping them would hide that.
inline double plain(std::int64_t size) {
  return size >= 0 && size < (1ll << 32) ? static_cast<double>(size) : 1.0;
}
inline double work(std::initializer_list<double> factors) {
  double w = 1;
  for (double f : factors) w *= f;
  return w;
}
inline constexpr double kMaxWork = 1 << 22;

}  // namespace dsa_fuzz
