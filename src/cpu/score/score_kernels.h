// Score microkernels of the fused CPU indexer, one set per ISA.
//
// A task holds a block of up to kQueryBlock query tokens of one sequence. The
// kernel packs the block once (pack_queries), then for each tile of up to
// kKeyTile keys computes, for every token t of the block and key s of the tile,
//   out[t][s] = sum_h w[t][h] * relu(q[t][h] . k[s])
// with `w` already multiplied by the indexer scale. Nothing here allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dsa/tensor.h"

namespace dsa::cpu::indexer_kernels {

inline constexpr std::int64_t kQueryBlock = 16;
inline constexpr std::int64_t kKeyTile = 64;

struct QueryBlockSource {
  const void* query;  // first token of the block
  DType dtype;
  std::int64_t row_stride, head_stride;  // elements
  std::int64_t tokens, heads, dim;
};

struct KeyTileSource {
  const void* keys;  // first key of the tile
  DType dtype;
  std::int64_t row_stride;  // elements
  std::int64_t count;       // <= kKeyTile; missing keys score 0
};

struct ScoreKernel {
  const char* name;
  // Bytes of the packed query block and of the key-tile scratch for these sizes.
  std::size_t (*packed_query_bytes)(std::int64_t heads, std::int64_t dim);
  std::size_t (*key_scratch_bytes)(std::int64_t dim);
  void (*pack_queries)(const QueryBlockSource& src, void* packed);
  // weights: [tokens][heads] fp32; out: [tokens][kKeyTile] fp32.
  void (*score_tile)(const void* packed, const QueryBlockSource& shape, const float* weights,
                     const KeyTileSource& keys, void* key_scratch, float* out);
  // Whether a key tile may be fp32 whatever the queries' dtype: the kernels
  // that score in fp32 (FMA, portable) widen every key anyway, so the decode
  // indexer hands them FP8 keys decoded straight to fp32. The bf16 pair
  // kernels (avx512_bf16, AMX) take keys of the queries' dtype only.
  bool accepts_f32_keys = false;
};

// Each returns the kernel of its ISA; the caller checks the CPU first.
const ScoreKernel& portable_kernel();
const ScoreKernel& avx2_kernel();
const ScoreKernel& avx512_kernel();
const ScoreKernel& avx512_bf16_kernel();  // bf16 inputs only
const ScoreKernel& amx_kernel();          // bf16 inputs only

// The best kernel this CPU runs for inputs of this dtype (the indexer's and
// dense_indexer_lse's dispatch).
const ScoreKernel& pick_score_kernel(DType dtype);

}  // namespace dsa::cpu::indexer_kernels
