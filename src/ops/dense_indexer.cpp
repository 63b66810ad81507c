// dsa::dense_indexer_lse / dense_indexer_kl_loss_{fwd,bwd}: validation,
// problem set-up and backend dispatch.
#include <cmath>

#include "core/memory.h"
#include "core/thread_pool.h"
#include "core/validate.h"
#include "ops/op_table.h"
#include "dsa/dense_indexer.h"
#include "ops/indexer.h"
#include "ops/kl_loss.h"

namespace dsa {
namespace {

using namespace core;

HeadMatrix weights_matrix(const TensorView& w, int lead) {
  HeadMatrix m = detail::head_matrix(w, lead, "head_weights");
  m.heads = w.size(-1);
  m.head_stride = w.stride(-1);
  m.dim = 1;
  return m;
}

void require_lse(const TensorView& lse, const TensorView& index_query, int lead) {
  require_present(lse, "indexer_lse");
  require_cpu(lse, "indexer_lse");
  require_dtype(lse, "indexer_lse", {DType::f32});
  require_contiguous(lse, "indexer_lse");
  require_ndim(lse, "indexer_lse", {1 + lead}, lead ? "[B, Sq]" : "[T]");
  for (int d = 0; d <= lead; ++d)
    require_size(lse, "indexer_lse", d, index_query.size(d), "the leading dims of index_query");
}

// Builds the dense KL problem shared by the forward and the backward.
DenseKlProblem make_dense_kl(const DenseIndexerKlInputs& in, const DenseIndexerKlParams& params, Backend& backend) {
  const TensorView &index_query = in.index_query, &index_key = in.index_key, &head_weights = in.head_weights,
                   &query = in.query, &key = in.key, &softmax_max = in.softmax_max, &softmax_sum = in.softmax_sum,
                   &indexer_lse = in.indexer_lse, &query_rope = in.query_rope, &key_rope = in.key_rope;
  const bool tnd = params.layout == Layout::TND;
  const int lead = tnd ? 0 : 1;
  require_float_input(query, "query", {3 + lead}, tnd ? "[T, H, D]" : "[B, Sq, H, D]");
  backend = resolve_backend(backend, query.device);
  validate_indexer_inputs(index_query, index_key, head_weights, "head_weights", lead);
  require_float_input(key, "key", {2 + lead, 3 + lead}, tnd ? "[S, Hk, D] or [S, D]" : "[B, Sk, Hk, D] or [B, Sk, D]");
  if (key.dtype != query.dtype)
    fail_argument("key: expected the dtype of query (", dtype_name(query.dtype), "), got ", dtype_name(key.dtype));
  require_size(key, "key", -1, query.size(-1), "D of query");
  for (int d = 0; d <= lead; ++d) require_size(query, "query", d, index_query.size(d), "the leading dims of index_query");
  if (!tnd) require_size(key, "key", 0, query.size(0), "B of query");
  require_size(key, "key", lead, index_key.size(lead), "the key rows of index_key");
  const std::int64_t heads = query.size(-2);
  const std::int64_t key_heads = key.ndim == 3 + lead ? key.size(-2) : 1;
  if (key_heads <= 0 || heads % key_heads != 0)
    fail_argument("key: expected a number of key heads Hk that divides H = ", heads, ", got Hk = ", key_heads);
  detail::require_statistics(softmax_max, "softmax_max", query, lead);
  detail::require_statistics(softmax_sum, "softmax_sum", query, lead);
  require_lse(indexer_lse, index_query, lead);
  if (query_rope.present() != key_rope.present())
    fail_argument(query_rope.present() ? "key_rope" : "query_rope",
                  ": query_rope and key_rope must be given together");
  if (query_rope.present()) {
    require_float_input(query_rope, "query_rope", {3 + lead}, tnd ? "[T, H, Dr]" : "[B, Sq, H, Dr]");
    require_float_input(key_rope, "key_rope", {key.ndim}, "the shape of key with Dr as its last dim");
    require_dtype(query_rope, "query_rope", {query.dtype});
    require_dtype(key_rope, "key_rope", {query.dtype});
    for (int d = 0; d < 2 + lead; ++d) require_size(query_rope, "query_rope", d, query.size(d), "the leading dims and heads of query");
    for (int d = 0; d < key.ndim - 1; ++d) require_size(key_rope, "key_rope", d, key.size(d), "the leading dims and heads of key");
    require_size(key_rope, "key_rope", -1, query_rope.size(-1), "Dr of query_rope");
    require_rope_dim_fits(query.size(-1), query_rope.size(-1));
  }
  if (!std::isfinite(params.scale)) fail_argument("scale: expected a finite number, got ", params.scale);
  if (!std::isfinite(params.index_scale)) fail_argument("index_scale: expected a finite number, got ", params.index_scale);
  if (!std::isfinite(params.loss_coefficient))
    fail_argument("loss_coefficient: expected a finite number, got ", params.loss_coefficient);

  DenseKlProblem p;
  p.plan = plan_indexer_sequences(index_query, index_key, params.layout, 1, params.cu_seqlens_q,
                                  params.cu_seqlens_k, lead);
  p.index_query = detail::head_matrix(index_query, lead, "index_query");
  p.index_key = detail::head_matrix(index_key, lead, "index_key");
  p.weights = weights_matrix(head_weights, lead);
  p.query = detail::head_matrix(query, lead, "query");
  p.query_rope = detail::head_matrix(query_rope, lead, "query_rope");
  p.key = detail::head_matrix(key, lead, "key");
  p.key_rope = detail::head_matrix(key_rope, lead, "key_rope");
  p.softmax_max = softmax_max.ptr<float>();
  p.softmax_sum = softmax_sum.ptr<float>();
  p.lse = indexer_lse.ptr<float>();
  p.scale = params.scale;
  p.index_scale = params.index_scale;
  p.coefficient = params.loss_coefficient;
  p.reduction = params.reduction;
  p.num_threads = resolve_num_threads(params.num_threads);
  p.key_rows = tnd ? index_key.size(0) : index_key.size(0) * index_key.size(1);
  return p;
}

}  // namespace

void dense_indexer_lse(const TensorView& index_query, const TensorView& index_key,
                       const TensorView& head_weights, const DenseIndexerLseParams& params,
                       const TensorView& indexer_lse, Backend backend) {
  const bool tnd = params.layout == Layout::TND;
  const int lead = tnd ? 0 : 1;
  require_float_input(index_query, "index_query", {3 + lead}, tnd ? "[T, Hi, Di]" : "[B, Sq, Hi, Di]");
  backend = resolve_backend(backend, index_query.device);
  validate_indexer_inputs(index_query, index_key, head_weights, "head_weights", lead);
  if (params.cmp_ratio < 1) fail_argument("cmp_ratio: expected an integer >= 1, got ", params.cmp_ratio);
  if (!std::isfinite(params.scale)) fail_argument("scale: expected a finite number, got ", params.scale);
  require_lse(indexer_lse, index_query, lead);

  DenseLseProblem p;
  p.plan = plan_indexer_sequences(index_query, index_key, params.layout, params.cmp_ratio, params.cu_seqlens_q,
                                  params.cu_seqlens_k, lead);
  p.index_query = detail::head_matrix(index_query, lead, "index_query");
  p.index_key = detail::head_matrix(index_key, lead, "index_key");
  p.weights = weights_matrix(head_weights, lead);
  p.scale = params.scale;
  p.ratio = params.cmp_ratio;
  p.num_threads = resolve_num_threads(params.num_threads);
  p.lse = indexer_lse.ptr<float>();
  ops::dispatch(&ops::OpTable::dense_indexer_lse, backend, p);
}

void dense_indexer_kl_loss_fwd(const DenseIndexerKlInputs& inputs, const DenseIndexerKlParams& params,
                               const TensorView& loss, Backend backend) {
  DenseKlProblem p = make_dense_kl(inputs, params, backend);
  require_present(loss, "loss");
  require_cpu(loss, "loss");
  require_dtype(loss, "loss", {DType::f32});
  if (loss.numel() != 1) fail_argument("loss: expected one element, got shape ", shape_string(loss));
  p.loss = loss.ptr<float>();
  ops::dispatch(&ops::OpTable::dense_indexer_kl_loss_fwd, backend, p);
}

void dense_indexer_kl_loss_bwd(const DenseIndexerKlInputs& inputs, float grad_loss,
                               const DenseIndexerKlParams& params, const DenseIndexerKlGrads& grads,
                               Backend backend) {
  DenseKlProblem p = make_dense_kl(inputs, params, backend);
  if (!std::isfinite(grad_loss)) fail_argument("grad_loss: expected a finite number, got ", grad_loss);
  detail::require_gradient_output(grads.d_index_query, inputs.index_query, "d_index_query");
  detail::require_gradient_output(grads.d_index_key, inputs.index_key, "d_index_key");
  detail::require_gradient_output(grads.d_head_weights, inputs.head_weights, "d_head_weights");
  p.grad_loss = grad_loss;
  p.d_index_query = grads.d_index_query.data;
  p.d_index_key = grads.d_index_key.data;
  p.d_weights = grads.d_head_weights.data;
  ops::dispatch(&ops::OpTable::dense_indexer_kl_loss_bwd, backend, p);
}

}  // namespace dsa
