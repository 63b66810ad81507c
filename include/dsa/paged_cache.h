// Paged caches for decode (docs/serving.md): the per-token rows a decode op
// reads (V3.2's latent KV and indexer keys; V4's window KV, compressed entries
// and CSA indexer keys), stored page-major with a block table per request.
//
// A cache is one byte tensor [num_blocks, block_size, token_bytes] (uint8),
// whatever the storage dtype, so that FP8 values, their fp32 scales and the
// bf16 RoPE part of a token sit in one record:
//   f32:       dim fp32 values                                 4 * dim bytes
//   bf16:      dim bf16 values                                 2 * dim bytes
//   fp8_e4m3:  (dim - rope_dim) e4m3 values, then one fp32 scale per group of
//              128 of them (the last group may be shorter), then rope_dim bf16
//              values                                          see cache_token_bytes
// (V3.2 latent, dim 576 with rope 64: 1152 B bf16, 656 B FP8, FlashMLA's
// record; an indexer key, dim 128: 256 B bf16, 132 B FP8, DeepGEMM's bytes.)
// A scale is a power of two, 2^ceil(log2(amax / 448)) (at least 2^-126), so that
// dequantising is exact in fp32, and in bf16 but for values under 2^-130 (a
// group of amax below 448 * 2^-126), which bf16 rounds.
//
// Token `pos` of request b lives in block block_table[b, pos / block_size] at
// row pos % block_size. A ring cache (V4's window: only the last `window`
// tokens are ever read) reuses its columns: block_table[b, (pos / block_size)
// % width]. A block id of -1 marks a column with no block; reading or writing
// through it is an error.
#pragma once

#include <cstdint>

#include "dsa/backend.h"
#include "dsa/tensor.h"

namespace dsa {

// f32: exact storage, for fp32 models whose generation must equal the
// unpatched model token for token (a bf16 cache rounds the latent).
enum class CacheDType : int { bf16, fp8_e4m3, f32 };

const char* cache_dtype_name(CacheDType dtype);
// "fp32" | "bf16" | "fp8" (also "float32", "bfloat16", "fp8_e4m3"); dsa::Error
// naming `cache_dtype` otherwise.
CacheDType parse_cache_dtype(const char* name);

// What one token of a cache holds. block_size comes from the cache tensor.
struct CacheLayout {
  CacheDType dtype = CacheDType::bf16;
  std::int64_t dim = 0;       // values per token
  std::int64_t rope_dim = 0;  // trailing values kept in bf16 by an FP8 cache
  bool ring = false;          // columns of the block table reused cyclically
};

inline constexpr std::int64_t kCacheScaleGroup = 128;  // FP8 values per fp32 scale
inline constexpr std::int64_t kDefaultCacheBlockSize = 64;

// Bytes of one token's record (dsa::Error on a layout that is not valid).
std::int64_t cache_token_bytes(const CacheLayout& layout);

struct CacheWriteParams {
  CacheLayout layout;
  int num_threads = 0;  // 0: default_num_threads()
};

// Stores new tokens, quantising them where the cache is FP8.
//   cache        [num_blocks, block_size, token_bytes] uint8, contiguous, written
//   block_table  [B, width] int32
//   positions    [B, n] int32 or int64: the absolute position of each value row
//                in its request; -1 skips the row (ragged batches)
//   values       [B, n, dim] bf16, fp16 or fp32, unit stride in the last dim
// Two rows that land in the same slot are an error (their order would decide).
void cache_write(const TensorView& cache, const TensorView& block_table, const TensorView& positions,
                 const TensorView& values, const CacheWriteParams& params,
                 Backend backend = Backend::automatic);

// Reads tokens back (dequantised): out[b, i] = the token at positions[b, i],
// zeros where the position is -1. out [B, n, dim] fp32 or bf16, contiguous.
// The oracle of the decode ops' tests, and how a chunked prefill reads an FP8
// prefix back for the prefill ops.
void cache_gather(const TensorView& cache, const TensorView& block_table, const TensorView& positions,
                  const CacheWriteParams& params, const TensorView& out,
                  Backend backend = Backend::automatic);

}  // namespace dsa
