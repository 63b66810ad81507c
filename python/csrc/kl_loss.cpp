#include "tensor_view.h"

namespace dsa::python {

using Arr = nb::ndarray<>;
using OptArr = std::optional<nb::ndarray<>>;
using Cu = std::vector<std::int64_t>;

namespace {

// The inputs the dense KL's forward and backward both take.
DenseIndexerKlInputs dense_inputs(const Arr& index_query, const Arr& index_key, const Arr& head_weights,
                                        const Arr& query, const Arr& key, const Arr& softmax_max,
                                        const Arr& softmax_sum, const Arr& indexer_lse, const OptArr& query_rope,
                                        const OptArr& key_rope) {
  return {to_view(index_query, "index_query"), to_view(index_key, "index_key"),
          to_view(head_weights, "head_weights"), to_view(query, "query"), to_view(key, "key"),
          to_view(softmax_max, "softmax_max"), to_view(softmax_sum, "softmax_sum"),
          to_view(indexer_lse, "indexer_lse"), to_view(query_rope, "query_rope"), to_view(key_rope, "key_rope")};
}

}  // namespace

void register_kl_loss(nb::module_& m) {
  m.def("kl_loss_fwd",
        [](Arr query, Arr kv, Arr indices, Arr softmax_max, Arr softmax_sum, Arr index_query, Arr index_key,
           Arr weights, OptArr sinks, OptArr query_rope, OptArr key_rope, Arr loss, OptArr score_grad, double scale,
           double index_scale, std::int64_t cmp_ratio, Cu cu_q, Cu cu_k, const std::string& layout,
           double loss_coefficient, const std::string& reduction, const std::string& backend, int num_threads) {
          KlLossParams p;
          p.scale = static_cast<float>(scale);
          p.index_scale = static_cast<float>(index_scale);
          p.cmp_ratio = cmp_ratio;
          set_sequence_params(p, std::move(cu_q), std::move(cu_k), layout, num_threads);
          p.loss_coefficient = static_cast<float>(loss_coefficient);
          p.reduction = parse_reduction(reduction.c_str());
          const Backend b = parse_backend(backend);
          const KlLossInputs in{to_view(query, "query"), to_view(kv, "kv"), to_view(indices, "indices"),
                                to_view(softmax_max, "softmax_max"), to_view(softmax_sum, "softmax_sum"),
                                to_view(index_query, "index_query"), to_view(index_key, "index_key"),
                                to_view(weights, "weights"), to_view(sinks, "sinks"),
                                to_view(query_rope, "query_rope"), to_view(key_rope, "key_rope")};
          const TensorView out = to_view(loss, "loss"), sg = to_view(score_grad, "score_grad");
          nb::gil_scoped_release release;
          kl_loss_fwd(in, p, out, sg, b);
        });
  m.def("kl_loss_bwd",
        [](Arr indices, Arr index_query, Arr index_key, Arr weights, Arr score_grad, double grad_loss,
           Arr d_index_query, Arr d_index_key, Arr d_weights, double index_scale, std::int64_t cmp_ratio, Cu cu_q,
           Cu cu_k, const std::string& layout, const std::string& backend, int num_threads) {
          KlLossParams p;
          p.index_scale = static_cast<float>(index_scale);
          p.cmp_ratio = cmp_ratio;
          set_sequence_params(p, std::move(cu_q), std::move(cu_k), layout, num_threads);
          const Backend b = parse_backend(backend);
          KlLossInputs in;
          in.indices = to_view(indices, "indices");
          in.index_query = to_view(index_query, "index_query");
          in.index_key = to_view(index_key, "index_key");
          in.weights = to_view(weights, "weights");
          const TensorView sg = to_view(score_grad, "score_grad");
          const KlLossGrads grads{to_view(d_index_query, "d_index_query"), to_view(d_index_key, "d_index_key"),
                                  to_view(d_weights, "d_weights")};
          nb::gil_scoped_release release;
          kl_loss_bwd(in, sg, static_cast<float>(grad_loss), p, grads, b);
        });
  m.def("dense_indexer_lse",
        [](Arr index_query, Arr index_key, Arr head_weights, Arr lse, double scale, std::int64_t cmp_ratio, Cu cu_q,
           Cu cu_k, const std::string& layout, const std::string& backend, int num_threads) {
          DenseIndexerLseParams p;
          p.scale = static_cast<float>(scale);
          p.cmp_ratio = cmp_ratio;
          set_sequence_params(p, std::move(cu_q), std::move(cu_k), layout, num_threads);
          const Backend b = parse_backend(backend);
          const TensorView q = to_view(index_query, "index_query"), k = to_view(index_key, "index_key"),
                           w = to_view(head_weights, "head_weights"), l = to_view(lse, "indexer_lse");
          nb::gil_scoped_release release;
          dense_indexer_lse(q, k, w, p, l, b);
        });
  auto dense_params = [](double scale, double index_scale, Cu cu_q, Cu cu_k, const std::string& layout,
                         double loss_coefficient, const std::string& reduction, int num_threads) {
    DenseIndexerKlParams p;
    p.scale = static_cast<float>(scale);
    p.index_scale = static_cast<float>(index_scale);
    set_sequence_params(p, std::move(cu_q), std::move(cu_k), layout, num_threads);
    p.loss_coefficient = static_cast<float>(loss_coefficient);
    p.reduction = parse_reduction(reduction.c_str());
    return p;
  };
  m.def("dense_indexer_kl_loss_fwd",
        [dense_params](Arr index_query, Arr index_key, Arr head_weights, Arr query, Arr key, Arr softmax_max,
                       Arr softmax_sum, Arr indexer_lse, OptArr query_rope, OptArr key_rope, Arr loss, double scale,
                       double index_scale, Cu cu_q, Cu cu_k, const std::string& layout, double loss_coefficient,
                       const std::string& reduction, const std::string& backend, int num_threads) {
          const DenseIndexerKlParams p = dense_params(scale, index_scale, std::move(cu_q), std::move(cu_k), layout,
                                                      loss_coefficient, reduction, num_threads);
          const Backend b = parse_backend(backend);
          const auto v = dense_inputs(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum,
                                      indexer_lse, query_rope, key_rope);
          const TensorView out = to_view(loss, "loss");
          nb::gil_scoped_release release;
          dense_indexer_kl_loss_fwd(v, p, out, b);
        });
  m.def("dense_indexer_kl_loss_bwd",
        [dense_params](Arr index_query, Arr index_key, Arr head_weights, Arr query, Arr key, Arr softmax_max,
                       Arr softmax_sum, Arr indexer_lse, OptArr query_rope, OptArr key_rope, double grad_loss,
                       Arr d_index_query, Arr d_index_key, Arr d_head_weights, double scale, double index_scale,
                       Cu cu_q, Cu cu_k, const std::string& layout, double loss_coefficient,
                       const std::string& reduction, const std::string& backend, int num_threads) {
          const DenseIndexerKlParams p = dense_params(scale, index_scale, std::move(cu_q), std::move(cu_k), layout,
                                                      loss_coefficient, reduction, num_threads);
          const Backend b = parse_backend(backend);
          const auto v = dense_inputs(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum,
                                      indexer_lse, query_rope, key_rope);
          const DenseIndexerKlGrads grads{to_view(d_index_query, "d_index_query"),
                                          to_view(d_index_key, "d_index_key"),
                                          to_view(d_head_weights, "d_head_weights")};
          nb::gil_scoped_release release;
          dense_indexer_kl_loss_bwd(v, static_cast<float>(grad_loss), p, grads, b);
        });
}

}  // namespace dsa::python
