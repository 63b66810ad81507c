// dsa::sparse_attention_fwd / _bwd: validation, problem set-up and backend dispatch.
#include "ops/sparse_attention.h"

#include <algorithm>
#include <cmath>

#include "core/memory.h"
#include "core/thread_pool.h"
#include "core/validate.h"
#include "ops/op_table.h"
#include "dsa/sparse_attention.h"

namespace dsa {
namespace {

using namespace core;

struct Shapes {
  bool tnd;
  int lead;  // leading dims before the token dim's successors: 0 (TND) or 1 (BSND)
};

// A shared-head key-like tensor: [S, X] / [S, 1, X] (TND) or [B, S, X] / [B, S, 1, X].
void check_key_tensor(const TensorView& t, const char* name, const Shapes& s, DType dtype,
                      const char* shape_tnd, const char* shape_bsnd) {
  require_float_input(t, name, {2 + s.lead, 3 + s.lead}, s.tnd ? shape_tnd : shape_bsnd);
  if (t.dtype != dtype)
    fail_argument(name, ": expected the dtype of query (", dtype_name(dtype), "), got ",
                  dtype_name(t.dtype));
  if (t.ndim == 3 + s.lead) require_size(t, name, 1 + s.lead, 1, "one shared KV head");
}

// Row stride of a [.., rows, ..] tensor whose BSND batch and sequence dims merge.
std::int64_t merged_row_stride(const TensorView& t, const char* name, const Shapes& s) {
  const std::int64_t stride = t.stride(s.lead);
  if (!s.tnd) require_mergeable_rows(t, name);
  return stride;
}

void check_index_tensor(const TensorView& t, const char* name, const TensorView& query,
                        const Shapes& s) {
  require_cpu(t, name);
  require_dtype(t, name, {DType::i32});
  require_ndim(t, name, {2 + s.lead, 3 + s.lead},
               s.tnd ? "[T, K] or [T, 1, K]" : "[B, Sq, K] or [B, Sq, 1, K]");
  require_last_dim_contiguous(t, name);
  for (int d = 0; d <= s.lead; ++d) require_size(t, name, d, query.size(d), "the leading dims of query");
  if (t.ndim == 3 + s.lead) require_size(t, name, 1 + s.lead, 1, "one shared index head");
  if (t.size(-1) <= 0) fail_argument(name, ": expected at least one index per query (topk >= 1), got shape ", shape_string(t));
}

// Validates the inputs and fills everything of the problem but the outputs.
SparseAttentionProblem set_up(const SparseAttentionInputs& in, const SparseAttentionParams& params) {
  const Shapes s{params.layout == Layout::TND, params.layout == Layout::TND ? 0 : 1};
  require_float_input(in.query, "query", {3 + s.lead}, s.tnd ? "[T, H, D]" : "[B, Sq, H, D]");
  const DType dtype = in.query.dtype;
  check_key_tensor(in.kv, "kv", s, dtype, "[S, D] or [S, 1, D]", "[B, Sk, D] or [B, Sk, 1, D]");
  const std::int64_t heads = in.query.size(-2), dim = in.query.size(-1);
  if (heads <= 0) fail_argument("query: expected at least one head, got shape ", shape_string(in.query));
  if (dim <= 0) fail_argument("query: expected a non-empty head dim, got shape ", shape_string(in.query));
  require_size(in.kv, "kv", -1, dim, "D of query");
  if (!s.tnd) require_size(in.kv, "kv", 0, in.query.size(0), "B of query");

  SparseAttentionProblem p;
  p.dtype = dtype;
  p.heads = heads;
  p.dim = dim;
  p.d_v = params.d_v == 0 ? dim : params.d_v;
  if (params.d_v < 0 || p.d_v > dim)
    fail_argument("d_v: expected 1 <= d_v <= D = ", dim, " (values are the first d_v dims of kv), got ",
                  params.d_v);
  if (!std::isfinite(params.scale)) fail_argument("scale: expected a finite number, got ", params.scale);
  if (params.window < 0) fail_argument("window: expected a positive integer or None, got ", params.window);
  if (params.cmp_ratio < 1) fail_argument("cmp_ratio: expected an integer >= 1, got ", params.cmp_ratio);

  p.query = in.query.data;
  p.q_row_stride = merged_row_stride(in.query, "query", s);
  p.q_head_stride = in.query.stride(-2);
  p.kv = in.kv.data;
  p.kv_row_stride = merged_row_stride(in.kv, "kv", s);
  p.kv_rows = s.tnd ? in.kv.size(0) : in.kv.size(0) * in.kv.size(1);

  if (in.query_rope.present() != in.key_rope.present())
    fail_argument(in.query_rope.present() ? "key_rope" : "query_rope",
                  ": query_rope and key_rope must be given together");
  if (in.query_rope.present()) {
    require_float_input(in.query_rope, "query_rope", {3 + s.lead}, s.tnd ? "[T, H, Dr]" : "[B, Sq, H, Dr]");
    if (in.query_rope.dtype != dtype)
      fail_argument("query_rope: expected the dtype of query (", dtype_name(dtype), "), got ",
                    dtype_name(in.query_rope.dtype));
    for (int d = 0; d <= s.lead + 1; ++d)
      require_size(in.query_rope, "query_rope", d, in.query.size(d), "the leading dims and heads of query");
    check_key_tensor(in.key_rope, "key_rope", s, dtype, "[S, Dr] or [S, 1, Dr]", "[B, Sk, Dr] or [B, Sk, 1, Dr]");
    for (int d = 0; d <= s.lead; ++d)
      require_size(in.key_rope, "key_rope", d, in.kv.size(d), "the leading dims of kv");
    require_size(in.key_rope, "key_rope", -1, in.query_rope.size(-1), "Dr of query_rope");
    require_rope_dim_fits(dim, in.query_rope.size(-1));
    if (in.query_rope.size(-1) <= 0) fail_argument("query_rope: expected a non-empty rope dim");
    if (in.cmp_kv.present())
      fail_argument("query_rope/key_rope: cannot be combined with cmp_kv (compressed entries have no "
                    "separate rope part); concatenate the rope dims into kv and cmp_kv instead");
    p.rope_dim = in.query_rope.size(-1);
    p.query_rope = in.query_rope.data;
    p.qr_row_stride = merged_row_stride(in.query_rope, "query_rope", s);
    p.qr_head_stride = in.query_rope.stride(-2);
    p.key_rope = in.key_rope.data;
    p.kr_row_stride = merged_row_stride(in.key_rope, "key_rope", s);
  }

  if (in.indices.present()) {
    check_index_tensor(in.indices, "indices", in.query, s);
    if (params.window > 0)
      fail_argument("window: cannot be combined with indices (the indices select the raw part); "
                    "pass window=None");
    p.indices = in.indices.ptr<std::int32_t>();
    p.idx_row_stride = merged_row_stride(in.indices, "indices", s);
    p.topk = in.indices.size(-1);
  }
  p.window = params.window;

  if (in.cmp_kv.present()) {
    check_key_tensor(in.cmp_kv, "cmp_kv", s, dtype, "[S', D] or [S', 1, D]", "[B, Sk', D] or [B, Sk', 1, D]");
    require_size(in.cmp_kv, "cmp_kv", -1, dim, "D of query");
    if (!s.tnd) require_size(in.cmp_kv, "cmp_kv", 0, in.query.size(0), "B of query");
    if (params.cmp_ratio <= 1)
      fail_argument("cmp_ratio: cmp_kv needs a compress ratio > 1, got ", params.cmp_ratio);
    p.cmp_kv = in.cmp_kv.data;
    p.cmp_row_stride = merged_row_stride(in.cmp_kv, "cmp_kv", s);
    p.cmp_rows = s.tnd ? in.cmp_kv.size(0) : in.cmp_kv.size(0) * in.cmp_kv.size(1);
  } else if (params.cmp_ratio > 1) {
    fail_argument("cmp_ratio: a compress ratio > 1 (got ", params.cmp_ratio, ") needs cmp_kv");
  }
  if (in.cmp_indices.present()) {
    if (!in.cmp_kv.present()) fail_argument("cmp_indices: needs cmp_kv (the entries they address)");
    check_index_tensor(in.cmp_indices, "cmp_indices", in.query, s);
    p.cmp_indices = in.cmp_indices.ptr<std::int32_t>();
    p.cidx_row_stride = merged_row_stride(in.cmp_indices, "cmp_indices", s);
    p.cmp_topk = in.cmp_indices.size(-1);
  }
  if (in.sinks.present()) {
    require_cpu(in.sinks, "sinks");
    require_dtype(in.sinks, "sinks", {DType::f32});
    require_ndim(in.sinks, "sinks", {1}, "[H]");
    require_size(in.sinks, "sinks", 0, heads, "H of query");
    require_contiguous(in.sinks, "sinks");
    p.sinks = in.sinks.ptr<float>();
  }
  p.scale = params.scale;
  p.ratio = params.cmp_ratio;

  LengthSpec spec;
  spec.layout = params.layout;
  spec.batch = s.tnd ? 1 : in.query.size(0);
  spec.q_extent = in.query.size(s.lead);
  spec.k_extent = in.kv.size(s.lead);
  if (in.cmp_kv.present()) spec.c_extent = in.cmp_kv.size(s.lead);
  spec.ratio = params.cmp_ratio;
  spec.cu_q = &params.cu_seqlens_q;
  spec.cu_k = &params.cu_seqlens_k;
  p.plan = plan_sequences(spec);
  // A band at least as wide as every sequence's keys is the whole causal set;
  // clamping it there changes no row's keys and keeps the kernels' band
  // arithmetic (first + count + window) from overflowing for window = INT64_MAX
  // (found by fuzz_sparse_attention).
  std::int64_t longest = 1;
  for (const auto& seq : p.plan.seqs) longest = std::max(longest, seq.k_len);
  p.window = std::min(p.window, longest);
  if (p.indices)
    require_indices_in_sequences(p.plan, p.indices, p.idx_row_stride, p.topk, IndexSpace::raw, "indices");
  if (p.cmp_indices)
    require_indices_in_sequences(p.plan, p.cmp_indices, p.cidx_row_stride, p.cmp_topk,
                                 IndexSpace::compressed, "cmp_indices");
  p.num_threads = resolve_num_threads(params.num_threads);
  return p;
}

// An output: present, CPU, given dtype, contiguous, exactly `like`'s shape with
// the last dim replaced by `last` (or `like`'s last dim when last < 0).
void check_output(const TensorView& t, const char* name, DType dtype, const TensorView& like,
                  int dims, std::int64_t last) {
  require_present(t, name);
  require_cpu(t, name);
  require_dtype(t, name, {dtype});
  require_contiguous(t, name);
  if (t.ndim != dims) fail_argument(name, ": expected ", dims, " dims, got shape ", shape_string(t));
  for (int d = 0; d < dims - 1; ++d) require_size(t, name, d, like.size(d), "the shape of its input");
  require_size(t, name, dims - 1, last >= 0 ? last : like.size(dims - 1), "the shape of its input");
}

}  // namespace

void sparse_attention_fwd(const SparseAttentionInputs& inputs, const SparseAttentionParams& params,
                          const TensorView& out, const TensorView& softmax_max,
                          const TensorView& softmax_sum, Backend backend) {
  SparseAttentionProblem p = set_up(inputs, params);
  backend = resolve_backend(backend, inputs.query.device);
  const int qdims = inputs.query.ndim;
  check_output(out, "out", p.dtype, inputs.query, qdims, p.d_v);
  check_output(softmax_max, "softmax_max", DType::f32, inputs.query, qdims - 1, inputs.query.size(-2));
  check_output(softmax_sum, "softmax_sum", DType::f32, inputs.query, qdims - 1, inputs.query.size(-2));
  p.out = out.data;
  p.softmax_max = softmax_max.ptr<float>();
  p.softmax_sum = softmax_sum.ptr<float>();
  ops::dispatch(&ops::OpTable::sparse_attention_fwd, backend, p);
}

void sparse_attention_bwd(const SparseAttentionInputs& inputs, const SparseAttentionParams& params,
                          const TensorView& grad_out, const TensorView& out,
                          const TensorView& softmax_max, const TensorView& softmax_sum,
                          const SparseAttentionGrads& grads, Backend backend) {
  SparseAttentionProblem p = set_up(inputs, params);
  backend = resolve_backend(backend, inputs.query.device);
  const int qdims = inputs.query.ndim;
  const Shapes s{params.layout == Layout::TND, params.layout == Layout::TND ? 0 : 1};
  for (auto [t, name] : {std::pair{&grad_out, "grad_out"}, std::pair{&out, "out"}}) {
    require_float_input(*t, name, {qdims}, s.tnd ? "[T, H, d_v]" : "[B, Sq, H, d_v]");
    if (t->dtype != p.dtype)
      fail_argument(name, ": expected the dtype of query (", dtype_name(p.dtype), "), got ", dtype_name(t->dtype));
    for (int d = 0; d < qdims - 1; ++d) require_size(*t, name, d, inputs.query.size(d), "the leading dims and heads of query");
    require_size(*t, name, -1, p.d_v, "d_v");
  }
  for (auto [t, name] : {std::pair{&softmax_max, "softmax_max"}, std::pair{&softmax_sum, "softmax_sum"}}) {
    require_present(*t, name);
    require_cpu(*t, name);
    require_dtype(*t, name, {DType::f32});
    require_contiguous(*t, name);
    if (t->ndim != qdims - 1) fail_argument(name, ": expected shape [T, H] / [B, Sq, H], got ", shape_string(*t));
    for (int d = 0; d < qdims - 1; ++d) require_size(*t, name, d, inputs.query.size(d), "the leading dims and heads of query");
  }
  check_output(grads.d_query, "d_query", p.dtype, inputs.query, qdims, -1);
  check_output(grads.d_kv, "d_kv", p.dtype, inputs.kv, inputs.kv.ndim, -1);
  if (p.rope_dim) {
    check_output(grads.d_query_rope, "d_query_rope", p.dtype, inputs.query_rope, qdims, -1);
    check_output(grads.d_key_rope, "d_key_rope", p.dtype, inputs.key_rope, inputs.key_rope.ndim, -1);
  }
  if (p.cmp_kv) check_output(grads.d_cmp_kv, "d_cmp_kv", p.dtype, inputs.cmp_kv, inputs.cmp_kv.ndim, -1);
  if (p.sinks) check_output(grads.d_sinks, "d_sinks", DType::f32, inputs.sinks, 1, -1);

  p.grad_out = grad_out.data;
  p.go_row_stride = grad_out.stride(s.lead);
  p.go_head_stride = grad_out.stride(-2);
  if (!s.tnd) require_mergeable_rows(grad_out, "grad_out");
  p.fwd_out = out.data;
  p.o_row_stride = out.stride(s.lead);
  p.o_head_stride = out.stride(-2);
  if (!s.tnd) require_mergeable_rows(out, "out");
  p.saved_max = softmax_max.ptr<float>();
  p.saved_sum = softmax_sum.ptr<float>();
  p.d_query = grads.d_query.data;
  p.d_kv = grads.d_kv.data;
  if (p.rope_dim) {
    p.d_query_rope = grads.d_query_rope.data;
    p.d_key_rope = grads.d_key_rope.data;
  }
  if (p.cmp_kv) p.d_cmp_kv = grads.d_cmp_kv.data;
  if (p.sinks) p.d_sinks = grads.d_sinks.ptr<float>();
  ops::dispatch(&ops::OpTable::sparse_attention_bwd, backend, p);
}

}  // namespace dsa
