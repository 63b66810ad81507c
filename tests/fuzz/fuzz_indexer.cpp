// libFuzzer target of dsa::indexer_topk (forward only: the op has no backward).
#include "dsa/indexer.h"

#include "fuzz_common.h"

using namespace dsa_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  choose_isa(in);
  dsa::IndexerParams params;
  params.cmp_ratio = cmp_ratio(in);
  const Sequences seq = sequences(in, params.cmp_ratio, 40, 60);
  set_lengths(params, seq);
  params.topk = in.param(in.range(1, 70), 3000);
  params.scale = in.real(0.5f);
  params.num_threads = in.num_threads();
  const std::int64_t heads = in.size(8, 80), dim = in.size(40, 600);
  const std::int64_t key_rows = params.cmp_ratio > 1 ? seq.c_rows : seq.k_rows;
  if (work({plain(seq.q_rows), plain(key_rows) + 1, plain(heads), plain(dim), plain(seq.batch)}) > kMaxWork) return 0;

  Arena a(in);
  const DType dtype = in.float_dtype();
  TensorView query, key, weights, indices, scores;
  const bool key_head = in.flag();  // [S, 1, Di] instead of [S, Di]
  if (!a.view(query, in.dtype(dtype), seq.rows(seq.q_rows, {heads, dim})) ||
      !a.view(key, in.dtype(dtype), key_head ? seq.rows(key_rows, {1, dim}) : seq.rows(key_rows, {dim})) ||
      !a.view(weights, in.dtype(in.float_dtype()), seq.rows(seq.q_rows, {heads})) ||
      !a.view(indices, in.dtype(DType::i32), seq.rows(seq.q_rows, {params.topk})))
    return 0;
  const bool with_scores = in.flag();
  if (with_scores && !a.view(scores, in.dtype(DType::f32), seq.rows(seq.q_rows, {params.topk}))) return 0;
  const FloatFill fill{2.0f, in.rare(4)};
  a.fill(query, fill);
  a.fill(key, fill);
  a.fill(weights, fill);

  Agreement agree("indexer_topk");
  for (dsa::Backend backend : backends(in))
    agree.run([&] { dsa::indexer_topk(query, key, weights, params, indices, scores, backend); });
  return 0;
}
