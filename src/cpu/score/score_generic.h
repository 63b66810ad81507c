// fp32 score kernel written for the compiler's vectorizer. Included by
// score_portable.cpp, score_avx2.cpp and score_avx512.cpp, which compile
// it for their ISA and name it through DSA_GENERIC_KERNEL_NAME.
//
// Layout: the query block is converted once to fp32 [tokens][heads][dim]; each
// key tile is transposed to fp32 [dim][kKeyTile] so that one query element
// broadcast against a contiguous row of kKeyTile keys is a plain FMA stream.

#include <cstring>

#include "core/numeric.h"
#include "cpu/score/score_kernels.h"

namespace dsa::cpu::indexer_kernels {
namespace {

std::size_t generic_packed_query_bytes(std::int64_t heads, std::int64_t dim) {
  return static_cast<std::size_t>(kQueryBlock * heads * dim) * sizeof(float);
}

std::size_t generic_key_scratch_bytes(std::int64_t dim) {
  return static_cast<std::size_t>(dim * kKeyTile) * sizeof(float);
}

void generic_pack_queries(const QueryBlockSource& src, void* packed) {
  float* out = static_cast<float*>(packed);
  for (std::int64_t t = 0; t < src.tokens; ++t)
    for (std::int64_t h = 0; h < src.heads; ++h)
      core::load_row(static_cast<const char*>(src.query) +
                         (t * src.row_stride + h * src.head_stride) * dtype_size(src.dtype),
                     src.dtype, src.dim, out + (t * src.heads + h) * src.dim);
}

using core::relu;  // keeps NaN, like torch.relu

void generic_score_tile(const void* packed, const QueryBlockSource& shape, const float* weights,
                        const KeyTileSource& keys, void* key_scratch, float* out) {
  const std::int64_t dim = shape.dim, heads = shape.heads;
  float* kt = static_cast<float*>(key_scratch);  // [dim][kKeyTile]
  std::memset(kt, 0, sizeof(float) * dim * kKeyTile);
  const std::size_t esize = dtype_size(keys.dtype);
  for (std::int64_t s = 0; s < keys.count; ++s) {
    const char* row = static_cast<const char*>(keys.keys) + s * keys.row_stride * esize;
    for (std::int64_t d = 0; d < dim; ++d) kt[d * kKeyTile + s] = core::load_float(row, keys.dtype, d);
  }
  const float* q = static_cast<const float*>(packed);
  constexpr int kHeadBlock = 4;
  constexpr int kHalf = kKeyTile / 2;  // keys per pass: the accumulators stay in registers
  for (std::int64_t t = 0; t < shape.tokens; ++t) {
    for (int half = 0; half < 2; ++half) {
      const float* kth = kt + half * kHalf;
      float acc[kHalf] = {};
      std::int64_t h = 0;
      for (; h + kHeadBlock <= heads; h += kHeadBlock) {
        float dots[kHeadBlock][kHalf] = {};
        const float* qh = q + (t * heads + h) * dim;
        for (std::int64_t d = 0; d < dim; ++d) {
          const float* krow = kth + d * kKeyTile;
          for (int b = 0; b < kHeadBlock; ++b) {
            const float qv = qh[b * dim + d];
            for (int s = 0; s < kHalf; ++s) dots[b][s] += qv * krow[s];
          }
        }
        for (int b = 0; b < kHeadBlock; ++b) {
          const float w = weights[t * heads + h + b];
          for (int s = 0; s < kHalf; ++s) acc[s] += w * relu(dots[b][s]);
        }
      }
      for (; h < heads; ++h) {
        float dots[kHalf] = {};
        const float* qh = q + (t * heads + h) * dim;
        for (std::int64_t d = 0; d < dim; ++d)
          for (int s = 0; s < kHalf; ++s) dots[s] += qh[d] * kth[d * kKeyTile + s];
        const float w = weights[t * heads + h];
        for (int s = 0; s < kHalf; ++s) acc[s] += w * relu(dots[s]);
      }
      std::memcpy(out + t * kKeyTile + half * kHalf, acc, sizeof(acc));
    }
  }
}

}  // namespace

const ScoreKernel& DSA_GENERIC_KERNEL_NAME() {
  static const ScoreKernel kernel{DSA_GENERIC_KERNEL_LABEL, generic_packed_query_bytes,
                                  generic_key_scratch_bytes, generic_pack_queries,
                                  generic_score_tile, true};
  return kernel;
}

}  // namespace dsa::cpu::indexer_kernels
