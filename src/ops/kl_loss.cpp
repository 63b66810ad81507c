// dsa::kl_loss_fwd / kl_loss_bwd: validation, problem set-up and backend dispatch.
#include "ops/kl_loss.h"

#include <cmath>
#include <cstring>

#include "core/memory.h"
#include "core/thread_pool.h"
#include "core/validate.h"
#include "ops/op_table.h"
#include "ops/indexer.h"

namespace dsa {

Reduction parse_reduction(const char* name) {
  if (std::strcmp(name, "mean") == 0) return Reduction::mean;
  if (std::strcmp(name, "sum") == 0) return Reduction::sum;
  core::fail_argument("reduction: expected 'mean' or 'sum', got '", name, "'");
}

namespace detail {

HeadMatrix head_matrix(const TensorView& t, int lead, const char* name) {
  HeadMatrix m;
  if (!t.present()) return m;
  m.data = t.data;
  m.dtype = t.dtype;
  m.row_stride = t.stride(lead);
  const bool has_heads = t.ndim == lead + 3;
  m.heads = has_heads ? t.size(lead + 1) : 1;
  m.head_stride = has_heads ? t.stride(lead + 1) : 0;
  m.dim = t.size(-1);
  if (lead == 1) core::require_mergeable_rows(t, name);
  return m;
}

void require_gradient_output(const TensorView& grad, const TensorView& input, const char* name) {
  using namespace core;
  require_present(grad, name);
  require_cpu(grad, name);
  require_dtype(grad, name, {input.dtype});
  require_contiguous(grad, name);
  if (grad.ndim != input.ndim) fail_argument(name, ": expected the shape of its input ", shape_string(input), ", got ", shape_string(grad));
  for (int d = 0; d < grad.ndim; ++d)
    if (grad.size(d) != input.size(d))
      fail_argument(name, ": expected the shape of its input ", shape_string(input), ", got ", shape_string(grad));
}

void require_statistics(const TensorView& t, const char* name, const TensorView& query, int lead) {
  using namespace core;
  require_present(t, name);
  require_cpu(t, name);
  require_dtype(t, name, {DType::f32});
  require_contiguous(t, name);
  require_ndim(t, name, {2 + lead}, lead ? "[B, Sq, H]" : "[T, H]");
  for (int d = 0; d <= lead; ++d) require_size(t, name, d, query.size(d), "the leading dims of query");
  require_size(t, name, -1, query.size(-2), "H of query");
}

}  // namespace detail

namespace {

using namespace core;

// Checks shared by the forward and the backward: the indexer tensors and indices.
void validate_indexer_side(const TensorView& indices, const TensorView& index_query,
                           const TensorView& index_key, const TensorView& weights,
                           const KlLossParams& params, int lead) {
  const bool tnd = lead == 0;
  validate_indexer_inputs(index_query, index_key, weights, "weights", lead);

  require_present(indices, "indices");
  require_cpu(indices, "indices");
  require_dtype(indices, "indices", {DType::i32});
  require_ndim(indices, "indices", {2 + lead, 3 + lead}, tnd ? "[T, K] or [T, 1, K]" : "[B, Sq, K] or [B, Sq, 1, K]");
  require_last_dim_contiguous(indices, "indices");
  if (indices.ndim == 3 + lead) require_size(indices, "indices", 1 + lead, 1, "one index head");
  for (int d = 0; d <= lead; ++d)
    require_size(indices, "indices", d, index_query.size(d), "the leading dims of index_query");
  if (indices.size(-1) <= 0) fail_argument("indices: expected at least one entry per row (K > 0), got K = 0");
  if (!tnd) require_mergeable_rows(indices, "indices");

  if (params.cmp_ratio < 1) fail_argument("cmp_ratio: expected an integer >= 1, got ", params.cmp_ratio);
  if (!std::isfinite(params.index_scale)) fail_argument("index_scale: expected a finite number, got ", params.index_scale);
  if (!std::isfinite(params.loss_coefficient))
    fail_argument("loss_coefficient: expected a finite number, got ", params.loss_coefficient);
}

// score_grad: [rows, topk] fp32, the shape of indices (a forward output, the backward's input).
void require_score_grad(const TensorView& score_grad, const TensorView& indices, int lead) {
  require_cpu(score_grad, "score_grad");
  require_dtype(score_grad, "score_grad", {DType::f32});
  require_contiguous(score_grad, "score_grad");
  const std::int64_t rows = lead == 0 ? indices.size(0) : indices.size(0) * indices.size(1);
  if (score_grad.numel() != rows * indices.size(-1))
    fail_argument("score_grad: expected ", rows, " x ", indices.size(-1), " elements (the shape of indices), got shape ",
                  shape_string(score_grad));
}

void set_indexer_side(SparseKlIndexerSide& p, const TensorView& indices, const TensorView& index_query,
                      const TensorView& index_key, const TensorView& weights, const KlLossParams& params,
                      int lead) {
  p.plan = plan_indexer_sequences(index_query, index_key, params.layout, params.cmp_ratio, params.cu_seqlens_q,
                                  params.cu_seqlens_k, lead);
  p.indices = indices.ptr<std::int32_t>();
  p.index_row_stride = indices.stride(lead);
  p.topk = indices.size(-1);
  // With a ratio > 1 the indexer's keys, and so the indices, are compressed entries.
  require_indices_in_sequences(p.plan, p.indices, p.index_row_stride, p.topk,
                               params.cmp_ratio > 1 ? IndexSpace::compressed : IndexSpace::raw, "indices");
  p.index_query = detail::head_matrix(index_query, lead, "index_query");
  p.index_key = detail::head_matrix(index_key, lead, "index_key");
  p.weights = detail::head_matrix(weights, lead, "weights");
  p.weights.heads = weights.size(-1);
  p.weights.head_stride = weights.stride(-1);
  p.weights.dim = 1;
  p.index_scale = params.index_scale;
  p.ratio = params.cmp_ratio;
  p.num_threads = resolve_num_threads(params.num_threads);
}

}  // namespace

void kl_loss_fwd(const KlLossInputs& in, const KlLossParams& params, const TensorView& loss,
                 const TensorView& score_grad, Backend backend) {
  const TensorView &query = in.query, &kv = in.kv, &indices = in.indices, &softmax_max = in.softmax_max,
                   &softmax_sum = in.softmax_sum, &index_query = in.index_query, &index_key = in.index_key,
                   &weights = in.weights, &sinks = in.sinks, &query_rope = in.query_rope, &key_rope = in.key_rope;
  const bool tnd = params.layout == Layout::TND;
  const int lead = tnd ? 0 : 1;
  require_float_input(query, "query", {3 + lead}, tnd ? "[T, H, D]" : "[B, Sq, H, D]");
  backend = resolve_backend(backend, query.device);
  validate_indexer_side(indices, index_query, index_key, weights, params, lead);
  require_float_input(kv, "kv", {2 + lead, 3 + lead}, tnd ? "[S', D] or [S', 1, D]" : "[B, Sk', D] or [B, Sk', 1, D]");
  if (kv.dtype != query.dtype)
    fail_argument("kv: expected the dtype of query (", dtype_name(query.dtype), "), got ", dtype_name(kv.dtype));
  if (kv.ndim == 3 + lead) require_size(kv, "kv", 1 + lead, 1, "one shared KV head");
  require_size(kv, "kv", -1, query.size(-1), "D of query");
  for (int d = 0; d <= lead; ++d) require_size(query, "query", d, index_query.size(d), "the leading dims of index_query");
  if (!tnd) require_size(kv, "kv", 0, query.size(0), "B of query");
  require_size(kv, "kv", lead, index_key.size(lead), "the key rows of index_key (both address the same entries)");
  detail::require_statistics(softmax_max, "softmax_max", query, lead);
  detail::require_statistics(softmax_sum, "softmax_sum", query, lead);
  const std::int64_t heads = query.size(-2);
  if (sinks.present()) {
    require_cpu(sinks, "sinks");
    require_dtype(sinks, "sinks", {DType::f32});
    require_contiguous(sinks, "sinks");
    require_ndim(sinks, "sinks", {1}, "[H]");
    require_size(sinks, "sinks", 0, heads, "H of query");
  }
  if (query_rope.present() != key_rope.present())
    fail_argument(query_rope.present() ? "key_rope" : "query_rope",
                  ": query_rope and key_rope must be given together");
  if (query_rope.present()) {
    require_float_input(query_rope, "query_rope", {3 + lead}, tnd ? "[T, H, Dr]" : "[B, Sq, H, Dr]");
    require_float_input(key_rope, "key_rope", {2 + lead, 3 + lead}, tnd ? "[S', Dr] or [S', 1, Dr]" : "[B, Sk', Dr]");
    require_dtype(query_rope, "query_rope", {query.dtype});
    require_dtype(key_rope, "key_rope", {query.dtype});
    for (int d = 0; d < 2 + lead; ++d) require_size(query_rope, "query_rope", d, query.size(d), "the leading dims and heads of query");
    if (key_rope.ndim == 3 + lead) require_size(key_rope, "key_rope", 1 + lead, 1, "one shared key head");
    for (int d = 0; d <= lead; ++d) require_size(key_rope, "key_rope", d, kv.size(d), "the leading dims of kv");
    require_size(key_rope, "key_rope", -1, query_rope.size(-1), "Dr of query_rope");
    require_rope_dim_fits(query.size(-1), query_rope.size(-1));
  }
  if (!std::isfinite(params.scale)) fail_argument("scale: expected a finite number, got ", params.scale);
  require_present(loss, "loss");
  require_cpu(loss, "loss");
  require_dtype(loss, "loss", {DType::f32});
  if (loss.numel() != 1) fail_argument("loss: expected one element, got shape ", shape_string(loss));
  if (score_grad.present()) require_score_grad(score_grad, indices, lead);

  SparseKlProblem p;
  set_indexer_side(p, indices, index_query, index_key, weights, params, lead);
  p.query = detail::head_matrix(query, lead, "query");
  p.query_rope = detail::head_matrix(query_rope, lead, "query_rope");
  p.kv = detail::head_matrix(kv, lead, "kv");
  p.key_rope = detail::head_matrix(key_rope, lead, "key_rope");
  p.softmax_max = softmax_max.ptr<float>();
  p.softmax_sum = softmax_sum.ptr<float>();
  p.sinks = sinks.present() ? sinks.ptr<float>() : nullptr;
  p.scale = params.scale;
  p.coefficient = params.loss_coefficient;
  p.reduction = params.reduction;
  p.loss = loss.ptr<float>();
  p.score_grad = score_grad.present() ? score_grad.ptr<float>() : nullptr;
  ops::dispatch(&ops::OpTable::kl_loss_fwd, backend, p);
}

void kl_loss_bwd(const KlLossInputs& in, const TensorView& score_grad, float grad_loss, const KlLossParams& params,
                 const KlLossGrads& grads, Backend backend) {
  const TensorView &indices = in.indices, &index_query = in.index_query, &index_key = in.index_key,
                   &weights = in.weights;
  const TensorView &d_index_query = grads.d_index_query, &d_index_key = grads.d_index_key,
                   &d_weights = grads.d_weights;
  const bool tnd = params.layout == Layout::TND;
  const int lead = tnd ? 0 : 1;
  require_float_input(index_query, "index_query", {3 + lead}, tnd ? "[T, Hi, Di]" : "[B, Sq, Hi, Di]");
  backend = resolve_backend(backend, index_query.device);
  validate_indexer_side(indices, index_query, index_key, weights, params, lead);
  require_present(score_grad, "score_grad");
  require_score_grad(score_grad, indices, lead);
  if (!std::isfinite(grad_loss)) fail_argument("grad_loss: expected a finite number, got ", grad_loss);
  detail::require_gradient_output(d_index_query, index_query, "d_index_query");
  detail::require_gradient_output(d_index_key, index_key, "d_index_key");
  detail::require_gradient_output(d_weights, weights, "d_weights");

  SparseKlBackwardProblem p;
  set_indexer_side(p, indices, index_query, index_key, weights, params, lead);
  p.score_grad = score_grad.ptr<float>();
  p.grad_loss = grad_loss;
  p.key_rows = tnd ? index_key.size(0) : index_key.size(0) * index_key.size(1);
  p.d_index_query = d_index_query.data;
  p.d_index_key = d_index_key.data;
  p.d_weights = d_weights.data;
  ops::dispatch(&ops::OpTable::kl_loss_bwd, backend, p);
}

}  // namespace dsa
