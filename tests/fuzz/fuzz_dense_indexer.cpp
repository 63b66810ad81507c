// libFuzzer target of the dense indexer warm-up: dsa::dense_indexer_lse, then
// dense_indexer_kl_loss_fwd / _bwd on its result (or on arbitrary lse values).
#include "dsa/dense_indexer.h"

#include "fuzz_common.h"

using namespace dsa_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  choose_isa(in);
  // The KL loss reads raw keys only; the LSE alone may read compressed ones.
  dsa::DenseIndexerLseParams lse_params;
  lse_params.cmp_ratio = in.rare(4) ? cmp_ratio(in) : 1;
  const Sequences seq = sequences(in, lse_params.cmp_ratio, 24, 40);
  set_lengths(lse_params, seq);
  lse_params.scale = in.real(0.5f);
  lse_params.num_threads = in.num_threads();
  dsa::DenseIndexerKlParams kl_params;
  set_lengths(kl_params, seq);
  kl_params.scale = in.real(0.125f);
  kl_params.index_scale = in.rare(8) ? in.real(0.5f) : lse_params.scale;
  kl_params.loss_coefficient = in.real(1.0f);
  kl_params.reduction = in.flag() ? dsa::Reduction::sum : dsa::Reduction::mean;
  kl_params.num_threads = in.num_threads();
  const float grad_loss = in.real(1.0f);

  const std::int64_t heads = in.size(4, 70), dim = in.size(40, 300);
  const std::int64_t key_heads = in.rare(3) ? in.size(4, 16) : 1;
  const std::int64_t index_heads = in.size(8, 70), index_dim = in.size(40, 300);
  const bool with_rope = in.rare(3);
  const std::int64_t rope_dim = with_rope ? in.size(16, 70) : 0;
  const std::int64_t index_key_rows = lse_params.cmp_ratio > 1 ? seq.c_rows : seq.k_rows;
  const double pairs = seq.pairs + plain(seq.q_rows) * plain(seq.batch);  // + per-row work
  if (work({pairs, plain(heads) + plain(index_heads), plain(dim) + plain(rope_dim) + plain(index_dim)}) > kMaxWork)
    return 0;

  Arena a(in);
  const DType dtype = in.float_dtype(), index_dtype = in.float_dtype();
  TensorView index_query, index_key, head_weights, lse, query, key, softmax_max, softmax_sum, query_rope,
      key_rope, loss;
  auto key_like = [&](TensorView& v, DType dt, std::int64_t rows, std::int64_t kh, std::int64_t last) {
    return a.view(v, in.dtype(dt), kh > 1 || in.flag() ? seq.rows(rows, {kh, last}) : seq.rows(rows, {last}));
  };
  if (!a.view(index_query, in.dtype(index_dtype), seq.rows(seq.q_rows, {index_heads, index_dim})) ||
      !key_like(index_key, index_dtype, index_key_rows, 1, index_dim) ||
      !a.view(head_weights, in.dtype(in.float_dtype()), seq.rows(seq.q_rows, {index_heads})) ||
      !a.view(lse, in.dtype(DType::f32), seq.rows(seq.q_rows, {})) ||
      !a.view(query, in.dtype(dtype), seq.rows(seq.q_rows, {heads, dim})) ||
      !key_like(key, dtype, seq.k_rows, key_heads, dim) ||
      !a.view(softmax_max, in.dtype(DType::f32), seq.rows(seq.q_rows, {heads})) ||
      !a.view(softmax_sum, in.dtype(DType::f32), seq.rows(seq.q_rows, {heads})) ||
      !a.view(loss, in.dtype(DType::f32), in.flag() ? std::vector<std::int64_t>{1} : std::vector<std::int64_t>{}))
    return 0;
  if (with_rope && (!a.view(query_rope, in.dtype(dtype), seq.rows(seq.q_rows, {heads, rope_dim})) ||
                    !key_like(key_rope, dtype, seq.k_rows, key_heads, rope_dim)))
    return 0;
  const FloatFill fill{2.0f, in.rare(4)};
  for (TensorView* v : {&index_query, &index_key, &head_weights, &query, &key, &query_rope, &key_rope})
    a.fill(*v, fill);
  a.fill(softmax_max, FloatFill{4.0f, in.rare(3)});
  a.fill(softmax_sum, FloatFill{8.0f, in.rare(3), true});

  const std::vector<dsa::Backend> backends_used = backends(in);
  bool lse_ok = false;
  Agreement lse_agree("dense_indexer_lse");
  for (dsa::Backend backend : backends_used)
    lse_ok |= lse_agree.run(
        [&] { dsa::dense_indexer_lse(index_query, index_key, head_weights, lse_params, lse, backend); });
  if (!lse_ok || in.rare(8)) a.fill(lse, FloatFill{8.0f, in.rare(2)});

  const dsa::DenseIndexerKlInputs inputs{index_query, index_key, head_weights, query, key, softmax_max, softmax_sum,
                                         lse, query_rope, key_rope};
  Agreement fwd("dense_indexer_kl_loss_fwd");
  for (dsa::Backend backend : backends_used)
    fwd.run([&] { dsa::dense_indexer_kl_loss_fwd(inputs, kl_params, loss, backend); });
  TensorView d_index_query, d_index_key, d_head_weights;
  if (!a.like(d_index_query, index_query) || !a.like(d_index_key, index_key) || !a.like(d_head_weights, head_weights))
    return 0;
  Agreement bwd("dense_indexer_kl_loss_bwd");
  for (dsa::Backend backend : backends_used)
    bwd.run([&] {
      dsa::dense_indexer_kl_loss_bwd(inputs, grad_loss, kl_params, {d_index_query, d_index_key, d_head_weights},
                                     backend);
    });
  return 0;
}
