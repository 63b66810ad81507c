// The decode operators: dsa::indexer_decode and dsa::sparse_attention_decode
// over paged caches, and dsa::compressor_append (V4's compressor state).
#include "tensor_view.h"

namespace dsa::python {

void register_decode(nb::module_& m) {
  m.def(
      "indexer_decode",
      [](nb::ndarray<> index_query, nb::ndarray<> weights, nb::ndarray<> key_cache, nb::ndarray<> block_table,
         nb::ndarray<> context_lens, nb::ndarray<> indices, std::int64_t topk, double scale, std::int64_t cmp_ratio,
         const std::string& cache_dtype, const std::string& backend, int num_threads) {
        const TensorView q = to_view(index_query, "index_query"), w = to_view(weights, "weights"),
                         c = to_view(key_cache, "key_cache"), t = to_view(block_table, "block_table"),
                         l = to_view(context_lens, "context_lens"), o = to_view(indices, "indices");
        IndexerDecodeParams params;
        params.topk = topk;
        params.scale = static_cast<float>(scale);
        params.cmp_ratio = cmp_ratio;
        params.key_layout = make_cache_layout(q.ndim > 0 ? q.size(-1) : 0, 0, cache_dtype, false);
        params.num_threads = num_threads;
        const Backend b = parse_backend(backend);
        nb::gil_scoped_release release;
        indexer_decode(q, w, c, t, l, params, o, b);
      },
      nb::arg("index_query"), nb::arg("weights"), nb::arg("key_cache"), nb::arg("block_table"),
      nb::arg("context_lens"), nb::arg("indices"), nb::arg("topk"), nb::arg("scale"), nb::arg("cmp_ratio"),
      nb::arg("cache_dtype"), nb::arg("backend"), nb::arg("num_threads"));
  m.def(
      "sparse_attention_decode",
      [](nb::ndarray<> query, nb::ndarray<> kv_cache, nb::ndarray<> block_table, nb::ndarray<> context_lens,
         std::optional<nb::ndarray<>> indices, std::optional<nb::ndarray<>> topk_lens,
         std::optional<nb::ndarray<>> cmp_cache, std::optional<nb::ndarray<>> cmp_block_table,
         std::optional<nb::ndarray<>> cmp_indices, std::optional<nb::ndarray<>> sinks, nb::ndarray<> out,
         nb::ndarray<> lse, double scale, std::int64_t d_v, std::int64_t window, std::int64_t cmp_ratio,
         std::int64_t rope_dim, const std::string& cache_dtype, bool ring, const std::string& cmp_cache_dtype,
         const std::string& backend, int num_threads) {
        SparseAttentionDecodeInputs in;
        in.query = to_view(query, "query");
        in.kv_cache = to_view(kv_cache, "kv_cache");
        in.block_table = to_view(block_table, "block_table");
        in.context_lens = to_view(context_lens, "context_lens");
        in.indices = to_view(indices, "indices");
        in.topk_lens = to_view(topk_lens, "topk_lens");
        in.cmp_cache = to_view(cmp_cache, "cmp_cache");
        in.cmp_block_table = to_view(cmp_block_table, "cmp_block_table");
        in.cmp_indices = to_view(cmp_indices, "cmp_indices");
        in.sinks = to_view(sinks, "sinks");
        const TensorView o = to_view(out, "out"), l = to_view(lse, "lse");
        SparseAttentionDecodeParams params;
        params.scale = static_cast<float>(scale);
        params.d_v = d_v;
        params.window = window;
        params.cmp_ratio = cmp_ratio;
        const std::int64_t dim = in.query.ndim > 0 ? in.query.size(-1) : 0;
        params.kv_layout = make_cache_layout(dim, rope_dim, cache_dtype, ring);
        params.cmp_layout = make_cache_layout(dim, rope_dim, cmp_cache_dtype, false);
        params.num_threads = num_threads;
        const Backend b = parse_backend(backend);
        nb::gil_scoped_release release;
        sparse_attention_decode(in, params, o, l, b);
      },
      nb::arg("query"), nb::arg("kv_cache"), nb::arg("block_table"), nb::arg("context_lens"),
      nb::arg("indices").none(), nb::arg("topk_lens").none(), nb::arg("cmp_cache").none(),
      nb::arg("cmp_block_table").none(), nb::arg("cmp_indices").none(), nb::arg("sinks").none(), nb::arg("out"),
      nb::arg("lse"), nb::arg("scale"), nb::arg("d_v"), nb::arg("window"), nb::arg("cmp_ratio"),
      nb::arg("rope_dim"), nb::arg("cache_dtype"), nb::arg("ring"), nb::arg("cmp_cache_dtype"),
      nb::arg("backend"), nb::arg("num_threads"));
  m.def(
      "compressor_append",
      [](nb::ndarray<> kv, nb::ndarray<> gate, nb::ndarray<> position_bias, nb::ndarray<> state_kv,
         nb::ndarray<> state_gate, nb::ndarray<> lengths, std::optional<nb::ndarray<>> new_lens,
         nb::ndarray<> compressed, std::int64_t ratio, bool overlap, const std::string& backend, int num_threads) {
        const TensorView k = to_view(kv, "kv"), g = to_view(gate, "gate"), pb = to_view(position_bias, "position_bias"),
                         sk = to_view(state_kv, "state_kv"), sg = to_view(state_gate, "state_gate"),
                         l = to_view(lengths, "lengths"), n = to_view(new_lens, "new_lens"),
                         out = to_view(compressed, "compressed");
        CompressorAppendParams params;
        params.ratio = ratio;
        params.overlap = overlap;
        params.num_threads = num_threads;
        const Backend b = parse_backend(backend);
        nb::gil_scoped_release release;
        compressor_append(k, g, pb, sk, sg, l, n, params, out, b);
      },
      nb::arg("kv"), nb::arg("gate"), nb::arg("position_bias"), nb::arg("state_kv"), nb::arg("state_gate"),
      nb::arg("lengths"), nb::arg("new_lens").none(), nb::arg("compressed"), nb::arg("ratio"), nb::arg("overlap"),
      nb::arg("backend"), nb::arg("num_threads"));
  m.def("compressor_state_rows", &compressor_state_rows, nb::arg("ratio"), nb::arg("overlap"));
}

}  // namespace dsa::python
