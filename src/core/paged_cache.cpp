// Paged caches: layouts, names and the validation every decode op shares.
#include "core/paged_cache.h"

#include <cstring>
#include <limits>

#include "core/validate.h"

namespace dsa {

const char* cache_dtype_name(CacheDType dtype) {
  switch (dtype) {
    case CacheDType::f32: return "fp32";
    case CacheDType::bf16: return "bf16";
    case CacheDType::fp8_e4m3: return "fp8_e4m3";
  }
  return "unknown";
}

CacheDType parse_cache_dtype(const char* name) {
  if (std::strcmp(name, "fp32") == 0 || std::strcmp(name, "float32") == 0) return CacheDType::f32;
  if (std::strcmp(name, "bf16") == 0 || std::strcmp(name, "bfloat16") == 0) return CacheDType::bf16;
  if (std::strcmp(name, "fp8") == 0 || std::strcmp(name, "fp8_e4m3") == 0) return CacheDType::fp8_e4m3;
  core::fail_argument("cache_dtype: expected 'fp32', 'bf16' or 'fp8', got '", name, "'");
}

std::int64_t cache_token_bytes(const CacheLayout& l) {
  // Bounded so that no product of a token's offsets can overflow (a V3.2
  // latent has 576 values; nothing near this bound is a token).
  constexpr std::int64_t kMaxDim = std::int64_t{1} << 24;
  if (l.dim <= 0 || l.dim > kMaxDim)
    core::fail_argument("dim: expected the values per cached token in [1, ", kMaxDim, "], got ", l.dim);
  if (l.rope_dim < 0 || l.rope_dim > l.dim)
    core::fail_argument("rope_dim: expected a value in [0, dim = ", l.dim, "], got ", l.rope_dim);
  if (l.dtype == CacheDType::f32) return 4 * l.dim;
  if (l.dtype == CacheDType::bf16) return 2 * l.dim;
  if (l.dtype != CacheDType::fp8_e4m3)
    core::fail_argument("cache_dtype: expected fp32, bf16 or fp8_e4m3, got the value ", static_cast<int>(l.dtype));
  const std::int64_t nq = l.dim - l.rope_dim;
  return nq + 4 * ((nq + kCacheScaleGroup - 1) / kCacheScaleGroup) + 2 * l.rope_dim;
}

namespace core {

PagedCache validate_paged_cache(const TensorView& cache, const CacheLayout& layout, const char* name) {
  const std::int64_t token_bytes = cache_token_bytes(layout);
  require_present(cache, name);
  require_cpu(cache, name);
  require_dtype(cache, name, {DType::u8});
  require_ndim(cache, name, {3}, "[num_blocks, block_size, token_bytes]");
  require_contiguous(cache, name);
  if (cache.size(2) != token_bytes)
    fail_argument(name, ": expected ", token_bytes, " bytes per token (", cache_dtype_name(layout.dtype),
                  ", dim ", layout.dim, ", rope_dim ", layout.rope_dim, ") in dim 2, got shape ",
                  shape_string(cache));
  if (cache.size(1) < 1) fail_argument(name, ": expected a block size >= 1 in dim 1, got shape ", shape_string(cache));
  if (cache.size(0) > std::numeric_limits<std::int32_t>::max())
    fail_argument(name, ": at most 2^31 - 1 blocks (block tables are int32), got shape ", shape_string(cache));
  PagedCache c;
  c.data = static_cast<std::uint8_t*>(cache.data);
  c.num_blocks = cache.size(0);
  c.block_size = cache.size(1);
  c.token_bytes = token_bytes;
  c.layout = layout;
  return c;
}

BlockTable validate_block_table(const TensorView& block_table, std::int64_t batch, const PagedCache& cache,
                                const char* name) {
  require_present(block_table, name);
  require_cpu(block_table, name);
  require_dtype(block_table, name, {DType::i32});
  require_ndim(block_table, name, {2}, "[B, blocks per request]");
  require_size(block_table, name, 0, batch, "B, the requests");
  BlockTable t;
  t.data = block_table.ptr<const std::int32_t>();
  t.batch = batch;
  t.width = block_table.size(1);
  t.row_stride = block_table.stride(0);
  t.col_stride = block_table.stride(1);
  t.block_size = cache.block_size;
  t.ring = cache.layout.ring;
  t.num_blocks = cache.num_blocks;
  t.name = name;
  // The entries are checked where they are looked up (require_covered), not
  // here, so validation costs what the call reads: a walk over the whole table
  // costs its B * width even where a call reads one column, and an empty
  // [2^40, 0] table made its loop over the rows unbounded (fuzz_decode's
  // timeout be8973ca, with rows [2^40, 0, dim]).
  return t;
}

void require_covered(const BlockTable& t, std::int64_t b, std::int64_t first, std::int64_t end, const char* what) {
  if (first >= end) return;
  if (first < 0) fail_argument(what, ": position ", first, " of request ", b, " is negative");
  if (!t.ring && (end - 1) / t.block_size >= t.width)
    fail_argument(what, ": position ", end - 1, " of request ", b, " needs block table column ",
                  (end - 1) / t.block_size, ", but ", t.name, " has ", t.width, " columns of ", t.block_size,
                  " tokens");
  if (t.ring && (end - 1) / t.block_size - first / t.block_size >= t.width)
    fail_argument(what, ": positions ", first, "..", end - 1, " of request ", b, " span more blocks than the ",
                  t.width, " columns of the ring ", t.name);
  for (std::int64_t blk = first / t.block_size; blk <= (end - 1) / t.block_size; ++blk) {
    const std::int64_t column = t.ring ? blk % t.width : blk, id = t.block(b, column);
    if (id < -1 || id >= t.num_blocks)
      fail_argument(t.name, "[", b, ", ", column, "] = ", id, ": expected a block id in [0, ", t.num_blocks,
                    ") of the cache, or -1 for no block (read for ", what, ")");
    if (id < 0)
      fail_argument(what, ": position ", std::max(first, blk * t.block_size), " of request ", b,
                    " falls in block table column ", column, ", which has no block (-1)");
  }
}

std::vector<std::int64_t> read_lengths(const TensorView& lengths, const char* name, std::int64_t batch,
                                       std::int64_t limit, const char* limit_what) {
  require_present(lengths, name);
  require_cpu(lengths, name);
  require_dtype(lengths, name, {DType::i32, DType::i64});
  require_ndim(lengths, name, {1}, "[B]");
  require_size(lengths, name, 0, batch, "B, the requests");
  std::vector<std::int64_t> out(batch);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t v = lengths.dtype == DType::i32 ? lengths.ptr<const std::int32_t>()[b * lengths.stride(0)]
                                                       : lengths.ptr<const std::int64_t>()[b * lengths.stride(0)];
    if (v < 0 || v > limit)
      fail_argument(name, "[", b, "] = ", v, ": expected a value in [0, ", limit, "] (", limit_what, ")");
    out[b] = v;
  }
  return out;
}

}  // namespace core
}  // namespace dsa
