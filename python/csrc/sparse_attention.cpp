#include "tensor_view.h"

namespace dsa::python {
namespace {

SparseAttentionParams make_params(double scale, std::int64_t d_v, std::int64_t window, std::int64_t cmp_ratio,
                                  std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k,
                                  const std::string& layout, int num_threads) {
  SparseAttentionParams p;
  p.scale = static_cast<float>(scale);
  p.d_v = d_v;
  p.window = window;
  p.cmp_ratio = cmp_ratio;
  set_sequence_params(p, std::move(cu_seqlens_q), std::move(cu_seqlens_k), layout, num_threads);
  return p;
}

using Opt = std::optional<nb::ndarray<>>;

SparseAttentionInputs make_inputs(const nb::ndarray<>& query, const nb::ndarray<>& kv, const Opt& indices,
                                  const Opt& cmp_kv, const Opt& cmp_indices, const Opt& sinks,
                                  const Opt& query_rope, const Opt& key_rope) {
  SparseAttentionInputs in;
  in.query = to_view(query, "query");
  in.kv = to_view(kv, "kv");
  in.indices = to_view(indices, "indices");
  in.cmp_kv = to_view(cmp_kv, "cmp_kv");
  in.cmp_indices = to_view(cmp_indices, "cmp_indices");
  in.sinks = to_view(sinks, "sinks");
  in.query_rope = to_view(query_rope, "query_rope");
  in.key_rope = to_view(key_rope, "key_rope");
  return in;
}

}  // namespace

void register_sparse_attention(nb::module_& m) {
  m.def(
      "sparse_attention_fwd",
      [](nb::ndarray<> query, nb::ndarray<> kv, Opt indices, Opt cmp_kv, Opt cmp_indices, Opt sinks,
         Opt query_rope, Opt key_rope, nb::ndarray<> out, nb::ndarray<> softmax_max, nb::ndarray<> softmax_sum,
         double scale, std::int64_t d_v, std::int64_t window, std::int64_t cmp_ratio,
         std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k, const std::string& layout,
         const std::string& backend, int num_threads) {
        const SparseAttentionInputs in =
            make_inputs(query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope);
        const SparseAttentionParams p = make_params(scale, d_v, window, cmp_ratio, std::move(cu_seqlens_q),
                                                    std::move(cu_seqlens_k), layout, num_threads);
        const Backend b = parse_backend(backend);
        const TensorView o = to_view(out, "out"), mx = to_view(softmax_max, "softmax_max"),
                         sm = to_view(softmax_sum, "softmax_sum");
        nb::gil_scoped_release release;
        sparse_attention_fwd(in, p, o, mx, sm, b);
      },
      nb::arg("query"), nb::arg("kv"), nb::arg("indices").none(), nb::arg("cmp_kv").none(),
      nb::arg("cmp_indices").none(), nb::arg("sinks").none(), nb::arg("query_rope").none(),
      nb::arg("key_rope").none(), nb::arg("out"), nb::arg("softmax_max"), nb::arg("softmax_sum"),
      nb::arg("scale"), nb::arg("d_v"), nb::arg("window"), nb::arg("cmp_ratio"), nb::arg("cu_seqlens_q"),
      nb::arg("cu_seqlens_k"), nb::arg("layout"), nb::arg("backend"), nb::arg("num_threads"));

  m.def(
      "sparse_attention_bwd",
      [](nb::ndarray<> query, nb::ndarray<> kv, Opt indices, Opt cmp_kv, Opt cmp_indices, Opt sinks,
         Opt query_rope, Opt key_rope, nb::ndarray<> grad_out, nb::ndarray<> out, nb::ndarray<> softmax_max,
         nb::ndarray<> softmax_sum, nb::ndarray<> d_query, nb::ndarray<> d_kv, Opt d_cmp_kv, Opt d_sinks,
         Opt d_query_rope, Opt d_key_rope, double scale, std::int64_t d_v, std::int64_t window,
         std::int64_t cmp_ratio, std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k,
         const std::string& layout, const std::string& backend, int num_threads) {
        const SparseAttentionInputs in =
            make_inputs(query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope);
        const SparseAttentionParams p = make_params(scale, d_v, window, cmp_ratio, std::move(cu_seqlens_q),
                                                    std::move(cu_seqlens_k), layout, num_threads);
        const Backend b = parse_backend(backend);
        const TensorView go = to_view(grad_out, "grad_out"), o = to_view(out, "out"),
                         mx = to_view(softmax_max, "softmax_max"), sm = to_view(softmax_sum, "softmax_sum");
        SparseAttentionGrads g;
        g.d_query = to_view(d_query, "d_query");
        g.d_kv = to_view(d_kv, "d_kv");
        g.d_cmp_kv = to_view(d_cmp_kv, "d_cmp_kv");
        g.d_sinks = to_view(d_sinks, "d_sinks");
        g.d_query_rope = to_view(d_query_rope, "d_query_rope");
        g.d_key_rope = to_view(d_key_rope, "d_key_rope");
        nb::gil_scoped_release release;
        sparse_attention_bwd(in, p, go, o, mx, sm, g, b);
      },
      nb::arg("query"), nb::arg("kv"), nb::arg("indices").none(), nb::arg("cmp_kv").none(),
      nb::arg("cmp_indices").none(), nb::arg("sinks").none(), nb::arg("query_rope").none(),
      nb::arg("key_rope").none(), nb::arg("grad_out"), nb::arg("out"), nb::arg("softmax_max"),
      nb::arg("softmax_sum"), nb::arg("d_query"), nb::arg("d_kv"), nb::arg("d_cmp_kv").none(),
      nb::arg("d_sinks").none(), nb::arg("d_query_rope").none(), nb::arg("d_key_rope").none(),
      nb::arg("scale"), nb::arg("d_v"), nb::arg("window"), nb::arg("cmp_ratio"), nb::arg("cu_seqlens_q"),
      nb::arg("cu_seqlens_k"), nb::arg("layout"), nb::arg("backend"), nb::arg("num_threads"));
}

}  // namespace dsa::python
