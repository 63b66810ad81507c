// dsa::indexer_topk: validation, problem set-up and backend dispatch.
#include "ops/indexer.h"

#include <cmath>

#include "core/memory.h"
#include "core/thread_pool.h"
#include "core/validate.h"
#include "ops/op_table.h"
#include "dsa/indexer.h"

namespace dsa {

void validate_indexer_inputs(const TensorView& index_query, const TensorView& index_key,
                             const TensorView& weights, const char* weights_name, int lead) {
  using namespace core;
  const bool tnd = lead == 0;
  require_float_input(index_query, "index_query", {3 + lead}, tnd ? "[T, Hi, Di]" : "[B, Sq, Hi, Di]");
  require_float_input(index_key, "index_key", {2 + lead, 3 + lead},
                      tnd ? "[S, Di] or [S, 1, Di]" : "[B, Sk, Di] or [B, Sk, 1, Di]");
  require_float_input(weights, weights_name, {2 + lead}, tnd ? "[T, Hi]" : "[B, Sq, Hi]");
  if (index_key.dtype != index_query.dtype)
    fail_argument("index_key: expected the dtype of index_query (", dtype_name(index_query.dtype),
                  "), got ", dtype_name(index_key.dtype));
  if (index_key.ndim == 3 + lead) require_size(index_key, "index_key", 1 + lead, 1, "one shared key head");
  require_size(index_key, "index_key", -1, index_query.size(-1), "Di of index_query");
  for (int d = 0; d <= lead; ++d)
    require_size(weights, weights_name, d, index_query.size(d), "the leading dims of index_query");
  require_size(weights, weights_name, -1, index_query.size(-2), "Hi of index_query");
  if (!tnd) require_size(index_key, "index_key", 0, index_query.size(0), "B of index_query");
}

core::SequencePlan plan_indexer_sequences(const TensorView& index_query, const TensorView& index_key, Layout layout,
                                          std::int64_t ratio, const CuSeqlens& cu_q, const CuSeqlens& cu_k,
                                          int lead) {
  core::LengthSpec spec;
  spec.layout = layout;
  spec.batch = lead ? index_query.size(0) : 1;
  spec.q_extent = index_query.size(lead);
  const std::int64_t key_rows = index_key.size(lead);
  if (ratio > 1) spec.c_extent = key_rows; else spec.k_extent = key_rows;
  spec.ratio = ratio;
  spec.cu_q = &cu_q;
  spec.cu_k = &cu_k;
  return core::plan_sequences(spec);
}

void indexer_topk(const TensorView& index_query, const TensorView& index_key,
                  const TensorView& weights, const IndexerParams& params,
                  const TensorView& indices, const TensorView& scores, Backend backend) {
  using namespace core;
  const bool tnd = params.layout == Layout::TND;
  const int lead = tnd ? 0 : 1;  // BSND has one more leading dim
  validate_indexer_inputs(index_query, index_key, weights, "weights", lead);
  backend = resolve_backend(backend, index_query.device);
  const std::int64_t heads = index_query.size(-2), dim = index_query.size(-1);
  if (params.topk <= 0) fail_argument("topk: expected a positive integer, got ", params.topk);
  if (params.cmp_ratio < 1) fail_argument("cmp_ratio: expected an integer >= 1, got ", params.cmp_ratio);
  if (!std::isfinite(params.scale)) fail_argument("scale: expected a finite number, got ", params.scale);

  require_present(indices, "indices");
  require_cpu(indices, "indices");
  require_dtype(indices, "indices", {DType::i32});
  require_contiguous(indices, "indices");
  require_ndim(indices, "indices", {2 + lead}, tnd ? "[T, topk]" : "[B, Sq, topk]");
  for (int d = 0; d <= lead; ++d)
    require_size(indices, "indices", d, index_query.size(d), "the leading dims of index_query");
  require_size(indices, "indices", -1, params.topk, "topk");
  if (scores.present()) {
    require_cpu(scores, "scores");
    require_dtype(scores, "scores", {DType::f32});
    require_contiguous(scores, "scores");
    require_ndim(scores, "scores", {2 + lead}, "the shape of indices");
    for (int d = 0; d < scores.ndim; ++d)
      require_size(scores, "scores", d, indices.size(d), "the shape of indices");
  }

  IndexerProblem p;
  p.plan = plan_indexer_sequences(index_query, index_key, params.layout, params.cmp_ratio, params.cu_seqlens_q,
                                  params.cu_seqlens_k, lead);
  p.query = index_query.data;
  p.dtype = index_query.dtype;
  p.query_row_stride = index_query.stride(lead);
  p.query_head_stride = index_query.stride(lead + 1);
  if (!tnd) require_mergeable_rows(index_query, "index_query");
  p.heads = heads;
  p.dim = dim;
  p.key = index_key.data;
  p.key_row_stride = index_key.stride(lead);
  if (!tnd) require_mergeable_rows(index_key, "index_key");
  p.weights = weights.data;
  p.weights_dtype = weights.dtype;
  p.weights_row_stride = weights.stride(lead);
  p.weights_head_stride = weights.stride(lead + 1);
  if (!tnd) require_mergeable_rows(weights, "weights");
  p.indices = indices.ptr<std::int32_t>();
  p.scores = scores.present() ? scores.ptr<float>() : nullptr;
  p.topk = params.topk;
  p.scale = params.scale;
  p.ratio = params.cmp_ratio;
  p.num_threads = resolve_num_threads(params.num_threads);

  ops::dispatch(&ops::OpTable::indexer_topk, backend, p);
}

}  // namespace dsa
