#include "tensor_view.h"

namespace dsa::python {

namespace {
CompressorParams make_params(std::int64_t ratio, bool overlap, std::vector<std::int64_t> cu_seqlens,
                             const std::string& layout, int num_threads) {
  CompressorParams p;
  p.ratio = ratio;
  p.overlap = overlap;
  p.layout = parse_layout(layout);
  p.cu_seqlens = std::move(cu_seqlens);
  p.num_threads = num_threads;
  return p;
}
}  // namespace

void register_compressor(nb::module_& m) {
  m.def(
      "compressor_fwd",
      [](nb::ndarray<> kv, nb::ndarray<> gate, nb::ndarray<> position_bias, nb::ndarray<> compressed,
         std::int64_t ratio, bool overlap, std::vector<std::int64_t> cu_seqlens,
         const std::string& layout, const std::string& backend, int num_threads,
         std::optional<nb::ndarray<>> stats) {
        const CompressorParams p = make_params(ratio, overlap, std::move(cu_seqlens), layout, num_threads);
        const Backend b = parse_backend(backend);
        const TensorView k = to_view(kv, "kv"), g = to_view(gate, "gate"),
                         pb = to_view(position_bias, "position_bias"), out = to_view(compressed, "compressed");
        const TensorView st = to_view(stats, "stats");
        nb::gil_scoped_release release;
        if (stats) compressor_fwd(k, g, pb, p, out, st, b);
        else compressor_fwd(k, g, pb, p, out, b);
      },
      nb::arg("kv"), nb::arg("gate"), nb::arg("position_bias"), nb::arg("compressed"), nb::arg("ratio"),
      nb::arg("overlap"), nb::arg("cu_seqlens"), nb::arg("layout"), nb::arg("backend"),
      nb::arg("num_threads"), nb::arg("stats") = nb::none());
  m.def(
      "compressor_bwd",
      [](nb::ndarray<> grad_compressed, nb::ndarray<> kv, nb::ndarray<> gate, nb::ndarray<> position_bias,
         nb::ndarray<> grad_kv, nb::ndarray<> grad_gate, nb::ndarray<> grad_position_bias,
         std::int64_t ratio, bool overlap, std::vector<std::int64_t> cu_seqlens,
         const std::string& layout, const std::string& backend, int num_threads,
         std::optional<nb::ndarray<>> stats) {
        const CompressorParams p = make_params(ratio, overlap, std::move(cu_seqlens), layout, num_threads);
        const Backend b = parse_backend(backend);
        const TensorView go = to_view(grad_compressed, "grad_compressed"), k = to_view(kv, "kv"),
                         g = to_view(gate, "gate"), pb = to_view(position_bias, "position_bias"),
                         gk = to_view(grad_kv, "grad_kv"), gg = to_view(grad_gate, "grad_gate"),
                         gb = to_view(grad_position_bias, "grad_position_bias"), st = to_view(stats, "stats");
        nb::gil_scoped_release release;
        if (stats) compressor_bwd(go, k, g, pb, st, p, gk, gg, gb, b);
        else compressor_bwd(go, k, g, pb, p, gk, gg, gb, b);
      },
      nb::arg("grad_compressed"), nb::arg("kv"), nb::arg("gate"), nb::arg("position_bias"),
      nb::arg("grad_kv"), nb::arg("grad_gate"), nb::arg("grad_position_bias"), nb::arg("ratio"),
      nb::arg("overlap"), nb::arg("cu_seqlens"), nb::arg("layout"), nb::arg("backend"),
      nb::arg("num_threads"), nb::arg("stats") = nb::none());
  m.def("compressor_stats_min_slots", &compressor_stats_min_slots);
}

}  // namespace dsa::python
