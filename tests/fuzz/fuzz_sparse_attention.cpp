// libFuzzer target of dsa::sparse_attention_fwd / _bwd: explicit indices
// (V3.2), causal band or dense, compressed keys with and without cmp_indices
// (V4 CSA / HCA), sinks and rope parts, in every combination the bytes pick.
#include "dsa/sparse_attention.h"

#include "fuzz_common.h"

using namespace dsa_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  choose_isa(in);
  dsa::SparseAttentionParams params;
  params.cmp_ratio = cmp_ratio(in);
  const Sequences seq = sequences(in, params.cmp_ratio, 24, 40);
  set_lengths(params, seq);
  params.scale = in.real(0.125f);
  params.num_threads = in.num_threads();
  const std::int64_t heads = in.size(4, 70), dim = in.size(40, 600);
  params.d_v = in.param(in.flag() ? 0 : in.range(1, std::max<std::int64_t>(dim, 1)), 700);

  const bool with_indices = in.flag();
  const bool with_cmp = params.cmp_ratio > 1 || in.rare(16);  // the second: cmp_kv without a ratio
  const bool with_cmp_indices = with_cmp && in.flag();
  const bool with_rope = in.rare(with_cmp ? 16 : 3);
  const bool with_sinks = in.flag();
  params.window = with_indices && !in.rare(16) ? 0 : in.param(in.flag() ? 0 : in.range(1, 40), 100);
  const std::int64_t topk = with_indices ? in.size(16, 300) : 0;
  const std::int64_t cmp_topk = with_cmp_indices ? in.size(8, 100) : 0;
  const std::int64_t rope_dim = with_rope ? in.size(16, 70) : 0;
  const std::int64_t d_v = params.d_v > 0 && params.d_v <= dim ? params.d_v : dim;
  const double per_query =  // + 1: per-row work
      plain(topk) + plain(cmp_topk) + (with_indices ? 0 : plain(seq.k_rows)) + plain(seq.c_rows) + 1;
  if (work({per_query, plain(seq.q_rows), plain(heads), plain(dim) + plain(rope_dim), plain(seq.batch)}) > kMaxWork)
    return 0;

  Arena a(in);
  const DType dtype = in.float_dtype();
  dsa::SparseAttentionInputs x;
  auto key_like = [&](TensorView& v, std::int64_t rows, std::int64_t last) {
    return a.view(v, in.dtype(dtype), in.flag() ? seq.rows(rows, {1, last}) : seq.rows(rows, {last}));
  };
  if (!a.view(x.query, in.dtype(dtype), seq.rows(seq.q_rows, {heads, dim})) ||
      !key_like(x.kv, seq.k_rows, dim))
    return 0;
  if (with_indices && !a.view(x.indices, in.dtype(DType::i32), seq.rows(seq.q_rows, {topk}))) return 0;
  if (with_cmp && !key_like(x.cmp_kv, seq.c_rows, dim)) return 0;
  if (with_cmp_indices && !a.view(x.cmp_indices, in.dtype(DType::i32), seq.rows(seq.q_rows, {cmp_topk})))
    return 0;
  if (with_sinks && !a.view(x.sinks, in.dtype(DType::f32), {heads})) return 0;
  if (with_rope && (!a.view(x.query_rope, in.dtype(dtype), seq.rows(seq.q_rows, {heads, rope_dim})) ||
                    !key_like(x.key_rope, seq.k_rows, rope_dim)))
    return 0;
  const FloatFill fill{2.0f, in.rare(4)};
  for (TensorView* v : {&x.query, &x.kv, &x.cmp_kv, &x.query_rope, &x.key_rope}) a.fill(*v, fill);
  a.fill(x.sinks, FloatFill{4.0f, in.rare(3)});
  const bool wild = in.rare(4);
  a.fill_indices(x.indices, seq.k_rows, wild);
  a.fill_indices(x.cmp_indices, seq.c_rows, wild);
  if (!wild) {  // else positions outside their sequence too, which both backends must refuse
    fold_indices(x.indices, seq, false);
    fold_indices(x.cmp_indices, seq, true);
  }

  TensorView out, softmax_max, softmax_sum;
  if (!a.view(out, in.dtype(dtype), seq.rows(seq.q_rows, {heads, d_v})) ||
      !a.view(softmax_max, in.dtype(DType::f32), seq.rows(seq.q_rows, {heads})) ||
      !a.view(softmax_sum, in.dtype(DType::f32), seq.rows(seq.q_rows, {heads})))
    return 0;
  const std::vector<dsa::Backend> backends_used = backends(in);
  bool forward_ok = false;
  Agreement fwd("sparse_attention_fwd");
  for (dsa::Backend backend : backends_used)
    forward_ok |= fwd.run([&] { dsa::sparse_attention_fwd(x, params, out, softmax_max, softmax_sum, backend); });

  // The backward takes the forward's results, or (when it failed, or the
  // input asks) arbitrary ones: saved statistics that match nothing.
  if (!forward_ok || in.rare(8)) {
    a.fill(out, fill);
    a.fill(softmax_max, FloatFill{4.0f, in.rare(2)});
    a.fill(softmax_sum, FloatFill{4.0f, in.rare(2), true});
  }
  TensorView grad_out;
  dsa::SparseAttentionGrads g;
  if (!a.view(grad_out, in.dtype(dtype), seq.rows(seq.q_rows, {heads, d_v}))) return 0;
  a.fill(grad_out, fill);
  if (!a.like(g.d_query, x.query) || !a.like(g.d_kv, x.kv) || !a.like(g.d_cmp_kv, x.cmp_kv) ||
      !a.like(g.d_sinks, x.sinks) || !a.like(g.d_query_rope, x.query_rope) || !a.like(g.d_key_rope, x.key_rope))
    return 0;
  Agreement bwd("sparse_attention_bwd");
  for (dsa::Backend backend : backends_used)
    bwd.run([&] { dsa::sparse_attention_bwd(x, params, grad_out, out, softmax_max, softmax_sum, g, backend); });
  return 0;
}
