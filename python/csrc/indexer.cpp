#include "tensor_view.h"

namespace dsa::python {

void register_indexer(nb::module_& m) {
  m.def(
      "indexer_topk",
      [](nb::ndarray<> index_query, nb::ndarray<> index_key, nb::ndarray<> weights,
         nb::ndarray<> indices, std::optional<nb::ndarray<>> scores, std::int64_t topk, double scale,
         std::int64_t cmp_ratio, std::vector<std::int64_t> cu_seqlens_q,
         std::vector<std::int64_t> cu_seqlens_k, const std::string& layout, const std::string& backend,
         int num_threads) {
        IndexerParams p;
        p.topk = topk;
        p.scale = static_cast<float>(scale);
        p.cmp_ratio = cmp_ratio;
        set_sequence_params(p, std::move(cu_seqlens_q), std::move(cu_seqlens_k), layout, num_threads);
        const Backend b = parse_backend(backend);
        const TensorView q = to_view(index_query, "index_query"), k = to_view(index_key, "index_key"),
                         w = to_view(weights, "weights"), i = to_view(indices, "indices"),
                         s = to_view(scores, "scores");
        nb::gil_scoped_release release;
        indexer_topk(q, k, w, p, i, s, b);
      },
      nb::arg("index_query"), nb::arg("index_key"), nb::arg("weights"), nb::arg("indices"),
      nb::arg("scores").none(), nb::arg("topk"), nb::arg("scale"), nb::arg("cmp_ratio"),
      nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("layout"), nb::arg("backend"),
      nb::arg("num_threads"));
}

}  // namespace dsa::python
