#include "tensor_view.h"

namespace dsa::python {

void register_paged_cache(nb::module_& m) {
  m.def("cache_token_bytes", [](std::int64_t dim, std::int64_t rope_dim, const std::string& cache_dtype) {
    return cache_token_bytes(make_cache_layout(dim, rope_dim, cache_dtype, false));
  });
  m.def(
      "cache_write",
      [](nb::ndarray<> cache, nb::ndarray<> block_table, nb::ndarray<> positions, nb::ndarray<> values,
         std::int64_t rope_dim, const std::string& cache_dtype, bool ring, const std::string& backend,
         int num_threads) {
        const TensorView c = to_view(cache, "cache"), t = to_view(block_table, "block_table"),
                         p = to_view(positions, "positions"), v = to_view(values, "values");
        CacheWriteParams params;
        params.layout = make_cache_layout(v.ndim > 0 ? v.size(-1) : 0, rope_dim, cache_dtype, ring);
        params.num_threads = num_threads;
        const Backend b = parse_backend(backend);
        nb::gil_scoped_release release;
        cache_write(c, t, p, v, params, b);
      },
      nb::arg("cache"), nb::arg("block_table"), nb::arg("positions"), nb::arg("values"), nb::arg("rope_dim"),
      nb::arg("cache_dtype"), nb::arg("ring"), nb::arg("backend"), nb::arg("num_threads"));
  m.def(
      "cache_gather",
      [](nb::ndarray<> cache, nb::ndarray<> block_table, nb::ndarray<> positions, nb::ndarray<> out,
         std::int64_t rope_dim, const std::string& cache_dtype, bool ring, const std::string& backend,
         int num_threads) {
        const TensorView c = to_view(cache, "cache"), t = to_view(block_table, "block_table"),
                         p = to_view(positions, "positions"), o = to_view(out, "out");
        CacheWriteParams params;
        params.layout = make_cache_layout(o.ndim > 0 ? o.size(-1) : 0, rope_dim, cache_dtype, ring);
        params.num_threads = num_threads;
        const Backend b = parse_backend(backend);
        nb::gil_scoped_release release;
        cache_gather(c, t, p, params, o, b);
      },
      nb::arg("cache"), nb::arg("block_table"), nb::arg("positions"), nb::arg("out"), nb::arg("rope_dim"),
      nb::arg("cache_dtype"), nb::arg("ring"), nb::arg("backend"), nb::arg("num_threads"));
}

}  // namespace dsa::python
