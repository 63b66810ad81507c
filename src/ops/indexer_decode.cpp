// dsa::indexer_decode: validation, problem set-up and backend dispatch.
#include "ops/indexer_decode.h"

#include <cmath>
#include <limits>

#include "core/numeric.h"
#include "core/thread_pool.h"
#include "core/validate.h"
#include "dsa/indexer_decode.h"
#include "ops/op_table.h"

namespace dsa {

float IndexerDecodeProblem::weight(std::int64_t b, std::int64_t j, std::int64_t h) const {
  return core::load_float(weights, weights_dtype, b * w_batch_stride + j * w_row_stride + h * w_head_stride);
}

void indexer_decode(const TensorView& index_query, const TensorView& weights, const TensorView& key_cache,
                    const TensorView& block_table, const TensorView& context_lens,
                    const IndexerDecodeParams& params, const TensorView& indices, Backend backend) {
  using namespace core;
  IndexerDecodeProblem p;
  require_float_input(index_query, "index_query", {4}, "[B, next_n, Hi, Di]");
  p.dtype = index_query.dtype;
  p.batch = index_query.size(0);
  p.next_n = index_query.size(1);
  p.heads = index_query.size(2);
  p.dim = index_query.size(3);
  if (p.next_n < 1) fail_argument("index_query: expected next_n >= 1 rows per request in dim 1, got shape ", shape_string(index_query));
  if (p.heads < 1) fail_argument("index_query: expected at least one head, got shape ", shape_string(index_query));
  p.query = index_query.data;
  p.q_batch_stride = index_query.stride(0);
  p.q_row_stride = index_query.stride(1);
  p.q_head_stride = index_query.stride(2);
  require_float_input(weights, "weights", {3}, "[B, next_n, Hi]");
  for (int d = 0; d < 3; ++d) require_size(weights, "weights", d, index_query.size(d), "[B, next_n, Hi] of index_query");
  p.weights = weights.data;
  p.weights_dtype = weights.dtype;
  p.w_batch_stride = weights.stride(0);
  p.w_row_stride = weights.stride(1);
  p.w_head_stride = weights.stride(2);
  if (params.topk < 1 || params.topk > std::numeric_limits<std::int32_t>::max())
    fail_argument("topk: expected a value in [1, 2^31 - 1], got ", params.topk);
  p.topk = params.topk;
  if (params.cmp_ratio < 1) fail_argument("cmp_ratio: expected >= 1 (1: raw keys), got ", params.cmp_ratio);
  p.cmp_ratio = params.cmp_ratio;
  if (!std::isfinite(params.scale)) fail_argument("scale: expected a finite number, got ", params.scale);
  p.scale = params.scale;
  p.num_threads = resolve_num_threads(params.num_threads);

  // The output first: contiguous, so B and next_n are backed by memory
  // before any loop runs over them.
  require_present(indices, "indices");
  require_cpu(indices, "indices");
  require_dtype(indices, "indices", {DType::i32});
  require_ndim(indices, "indices", {3}, "[B, next_n, topk]");
  require_size(indices, "indices", 0, p.batch, "B of index_query");
  require_size(indices, "indices", 1, p.next_n, "next_n of index_query");
  require_size(indices, "indices", 2, p.topk, "topk");
  require_contiguous(indices, "indices");
  p.indices = indices.ptr<std::int32_t>();

  if (params.key_layout.dim != p.dim)
    fail_argument("key_layout: dim ", params.key_layout.dim, " differs from index_query's Di ", p.dim);
  if (params.key_layout.ring)
    fail_argument("key_layout: a ring cache drops old keys, and the indexer reads every one of them");
  p.keys = validate_paged_cache(key_cache, params.key_layout, "key_cache");
  p.table = validate_block_table(block_table, p.batch, p.keys, "block_table");
  p.context_lens = read_lengths(context_lens, "context_lens", p.batch, std::numeric_limits<std::int32_t>::max(),
                                "int32 positions");
  for (std::int64_t b = 0; b < p.batch; ++b) {
    if (p.context_lens[b] < p.next_n)
      fail_argument("context_lens[", b, "] = ", p.context_lens[b], ": expected at least next_n = ", p.next_n,
                    " (the rows asked for are the last next_n of the context)");
    // Every key the last row sees has a block: the kernels look slots up unchecked.
    require_covered(p.table, b, 0, p.visible(b, p.next_n - 1), "context_lens");
  }
  backend = resolve_backend(backend, index_query.device);
  ops::dispatch(&ops::OpTable::indexer_decode, backend, p);
}

}  // namespace dsa
