// Register-blocked fp32 FMA score kernel for AVX2 and AVX-512 (every input
// dtype; bf16 too on CPUs without a bf16 dot product). Included by
// score_avx2.cpp and score_avx512.cpp, named through DSA_FMA_KERNEL_NAME.
//
// Layout as in the generic kernel: the query block converted once to fp32
// [tokens][heads][dim], each key tile transposed to fp32 [dim][kKeyTile]. The
// dot products of kMr heads x kNr vectors of keys stay in registers over the
// whole dim; the ReLU and the weighted head sum are applied to them there, so
// no [heads][keys] block is ever stored.
#include <cstring>

#include "core/numeric.h"
#include "cpu/score/score_kernels.h"
#include "cpu/isa/fma.h"

namespace dsa::cpu::indexer_kernels {
namespace {

using namespace fma;

static_assert(kKeyTile % (kNr * kLanes) == 0, "a key tile is whole register blocks");

std::size_t fma_packed_query_bytes(std::int64_t heads, std::int64_t dim) {
  return static_cast<std::size_t>(kQueryBlock * heads * dim) * sizeof(float);
}

std::size_t fma_key_scratch_bytes(std::int64_t dim) { return static_cast<std::size_t>(dim * kKeyTile) * sizeof(float); }

void fma_pack_queries(const QueryBlockSource& src, void* packed) {
  float* out = static_cast<float*>(packed);
  const std::size_t es = dtype_size(src.dtype);
  for (std::int64_t t = 0; t < src.tokens; ++t)
    for (std::int64_t h = 0; h < src.heads; ++h)
      to_float(static_cast<const char*>(src.query) + (t * src.row_stride + h * src.head_stride) * es, src.dtype,
               src.dim, src.dim, out + (t * src.heads + h) * src.dim);
}

// out[0 .. kNr * kLanes) += sum over MR heads h of w[h] * relu(q_h . kt[:, cols]),
// heads in ascending order. relu keeps NaN (like torch.relu): max(0, x)
// returns x when x is NaN.
template <int MR>
void score_heads(const float* q, std::int64_t dim, const float* w, const float* kt, float* out) {
  Vec acc[MR][kNr];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < kNr; ++j) acc[r][j] = vzero();
  for (std::int64_t d = 0; d < dim; ++d) {
    Vec bv[kNr];
#pragma GCC unroll 8
    for (int j = 0; j < kNr; ++j) bv[j] = vload(kt + d * kKeyTile + j * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec av = vset(q[r * dim + d]);
#pragma GCC unroll 8
      for (int j = 0; j < kNr; ++j) acc[r][j] = vfma(av, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kNr; ++j) {
    Vec sum = vload(out + j * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) sum = vfma(vset(w[r]), vmax(vzero(), acc[r][j]), sum);
    vstore(out + j * kLanes, sum);
  }
}

using HeadsFn = void (*)(const float*, std::int64_t, const float*, const float*, float*);

template <int... MR>
constexpr auto heads_table(std::integer_sequence<int, MR...>) {
  return std::array<HeadsFn, sizeof...(MR)>{&score_heads<MR + 1>...};
}
constexpr auto kHeads = heads_table(std::make_integer_sequence<int, kMr>{});

void fma_score_tile(const void* packed, const QueryBlockSource& shape, const float* weights,
                    const KeyTileSource& keys, void* key_scratch, float* out) {
  const std::int64_t dim = shape.dim, heads = shape.heads;
  float* kt = static_cast<float*>(key_scratch);  // [dim][kKeyTile], missing keys zero
  const std::size_t es = dtype_size(keys.dtype);
  if (keys.count < kKeyTile) std::memset(kt, 0, sizeof(float) * dim * kKeyTile);
  // Whole groups of kLanes keys through fma::transpose's register transposes, a
  // chunk of dims at a time, instead of a scalar store per value: the same values
  // in the same places (the loop below does the rest). Decode scores one token per
  // key tile, so this copy was a sixth of the decode indexer's time at next_n = 1
  // (Zen 1 class, perf, one thread, when it was scalar).
  std::int64_t s0 = 0;
  if (dim % kLanes == 0) {
    constexpr std::int64_t kChunk = 256;
    alignas(64) float rows[kLanes * kChunk];  // kLanes keys' dims [d0, d0 + n)
    for (; s0 + kLanes <= keys.count; s0 += kLanes)
      for (std::int64_t d0 = 0; d0 < dim; d0 += kChunk) {
        const std::int64_t n = std::min(kChunk, dim - d0);
        if (keys.dtype == DType::f32) {  // fp32 rows (the decode indexer's decoded FP8 keys): no copy first
          transpose(static_cast<const float*>(keys.keys) + s0 * keys.row_stride + d0, keys.row_stride, kLanes, n,
                    kt + d0 * kKeyTile + s0, kKeyTile);
          continue;
        }
        for (int r = 0; r < kLanes; ++r)
          to_float(static_cast<const char*>(keys.keys) + ((s0 + r) * keys.row_stride + d0) * es, keys.dtype, n, n,
                   rows + r * kChunk);
        transpose(rows, kChunk, kLanes, n, kt + d0 * kKeyTile + s0, kKeyTile);
      }
  }
  float row[1024];  // one key row in fp32, a chunk of dims at a time
  for (std::int64_t s = s0; s < keys.count; ++s) {
    const char* src = static_cast<const char*>(keys.keys) + s * keys.row_stride * es;
    for (std::int64_t d0 = 0; d0 < dim; d0 += 1024) {
      const std::int64_t n = std::min<std::int64_t>(1024, dim - d0);
      to_float(src + d0 * es, keys.dtype, n, n, row);
      for (std::int64_t d = 0; d < n; ++d) kt[(d0 + d) * kKeyTile + s] = row[d];
    }
  }
  const float* q = static_cast<const float*>(packed);
  for (std::int64_t t = 0; t < shape.tokens; ++t) {
    float* o = out + t * kKeyTile;
    std::fill(o, o + kKeyTile, 0.0f);
    for (std::int64_t col = 0; col < kKeyTile; col += kNr * kLanes)
      for (std::int64_t h = 0; h < heads; h += kMr) {
        const int mr = static_cast<int>(std::min<std::int64_t>(kMr, heads - h));
        kHeads[mr - 1](q + (t * heads + h) * dim, dim, weights + t * heads + h, kt + col, o + col);
      }
  }
}

}  // namespace

const ScoreKernel& DSA_FMA_KERNEL_NAME() {
  static const ScoreKernel kernel{DSA_FMA_KERNEL_LABEL, fma_packed_query_bytes, fma_key_scratch_bytes,
                                  fma_pack_queries, fma_score_tile, true};
  return kernel;
}

}  // namespace dsa::cpu::indexer_kernels
