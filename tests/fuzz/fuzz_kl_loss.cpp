// libFuzzer target of dsa::kl_loss_fwd / _bwd (the sparse indexer KL loss),
// raw and compressed keys, with and without sinks and rope parts.
#include "dsa/kl_loss.h"

#include "fuzz_common.h"

using namespace dsa_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  choose_isa(in);
  dsa::KlLossParams params;
  params.cmp_ratio = cmp_ratio(in);
  const Sequences seq = sequences(in, params.cmp_ratio, 24, 40);
  set_lengths(params, seq);
  params.scale = in.real(0.125f);
  params.index_scale = in.real(0.5f);
  params.loss_coefficient = in.real(1.0f);
  params.reduction = in.flag() ? dsa::Reduction::sum : dsa::Reduction::mean;
  params.num_threads = in.num_threads();
  const float grad_loss = in.real(1.0f);
  const std::int64_t heads = in.size(4, 70), dim = in.size(40, 600);
  const std::int64_t index_heads = in.size(8, 70), index_dim = in.size(40, 300);
  const std::int64_t topk = in.size(16, 300);
  const bool with_rope = in.rare(3), with_sinks = in.flag(), with_score_grad = !in.rare(8);
  const std::int64_t rope_dim = with_rope ? in.size(16, 70) : 0;
  const std::int64_t key_rows = params.cmp_ratio > 1 ? seq.c_rows : seq.k_rows;
  if (work({plain(seq.q_rows), plain(topk) + 1, plain(heads) + plain(index_heads),
            plain(dim) + plain(rope_dim) + plain(index_dim), plain(seq.batch)}) > kMaxWork) return 0;

  Arena a(in);
  const DType dtype = in.float_dtype(), index_dtype = in.float_dtype();
  auto key_like = [&](TensorView& v, DType dt, std::int64_t last) {
    return a.view(v, in.dtype(dt), in.flag() ? seq.rows(key_rows, {1, last}) : seq.rows(key_rows, {last}));
  };
  TensorView query, kv, indices, softmax_max, softmax_sum, index_query, index_key, weights, sinks,
      query_rope, key_rope, loss, score_grad;
  if (!a.view(query, in.dtype(dtype), seq.rows(seq.q_rows, {heads, dim})) || !key_like(kv, dtype, dim) ||
      !a.view(indices, in.dtype(DType::i32),
              in.flag() ? seq.rows(seq.q_rows, {1, topk}) : seq.rows(seq.q_rows, {topk})) ||
      !a.view(softmax_max, in.dtype(DType::f32), seq.rows(seq.q_rows, {heads})) ||
      !a.view(softmax_sum, in.dtype(DType::f32), seq.rows(seq.q_rows, {heads})) ||
      !a.view(index_query, in.dtype(index_dtype), seq.rows(seq.q_rows, {index_heads, index_dim})) ||
      !key_like(index_key, index_dtype, index_dim) ||
      !a.view(weights, in.dtype(in.float_dtype()), seq.rows(seq.q_rows, {index_heads})) ||
      !a.view(loss, in.dtype(DType::f32), in.flag() ? std::vector<std::int64_t>{1} : std::vector<std::int64_t>{}))
    return 0;
  if (with_sinks && !a.view(sinks, in.dtype(DType::f32), {heads})) return 0;
  if (with_rope && (!a.view(query_rope, in.dtype(dtype), seq.rows(seq.q_rows, {heads, rope_dim})) ||
                    !key_like(key_rope, dtype, rope_dim)))
    return 0;
  if (with_score_grad && !a.view(score_grad, in.dtype(DType::f32), seq.rows(seq.q_rows, {topk}))) return 0;
  const FloatFill fill{2.0f, in.rare(4)};
  for (TensorView* v : {&query, &kv, &index_query, &index_key, &weights, &query_rope, &key_rope}) a.fill(*v, fill);
  a.fill(sinks, FloatFill{4.0f, in.rare(3)});
  a.fill(softmax_max, FloatFill{4.0f, in.rare(3)});
  a.fill(softmax_sum, FloatFill{8.0f, in.rare(3), true});
  const bool wild = in.rare(4);
  a.fill_indices(indices, key_rows, wild);
  // Unless wild, inside each sequence (else both backends must refuse them).
  if (!wild) fold_indices(indices, seq, params.cmp_ratio > 1);

  const std::vector<dsa::Backend> backends_used = backends(in);
  bool forward_ok = false;
  Agreement fwd("kl_loss_fwd");
  for (dsa::Backend backend : backends_used)
    forward_ok |= fwd.run([&] {
      dsa::kl_loss_fwd({query, kv, indices, softmax_max, softmax_sum, index_query, index_key, weights, sinks,
                        query_rope, key_rope},
                       params, loss, score_grad, backend);
    });

  // The backward from the forward's score_grad, or from arbitrary values.
  if (!forward_ok || in.rare(8)) a.fill(score_grad, FloatFill{1.0f, in.rare(2)});
  TensorView d_index_query, d_index_key, d_weights;
  if (!a.like(d_index_query, index_query) || !a.like(d_index_key, index_key) || !a.like(d_weights, weights)) return 0;
  Agreement bwd("kl_loss_bwd");
  for (dsa::Backend backend : backends_used)
    bwd.run([&] {
      dsa::KlLossInputs inputs;
      inputs.indices = indices, inputs.index_query = index_query, inputs.index_key = index_key;
      inputs.weights = weights;
      dsa::kl_loss_bwd(inputs, score_grad, grad_loss, params, {d_index_query, d_index_key, d_weights}, backend);
    });
  return 0;
}
