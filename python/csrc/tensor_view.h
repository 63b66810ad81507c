// DLPack (nanobind ndarray) <-> dsa::TensorView translation.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dsa/dsa.h"

namespace dsa::python {

namespace nb = nanobind;

// Views a DLPack tensor; `name` appears in the error when its dtype is unknown.
TensorView to_view(const nb::ndarray<>& array, const char* name);
TensorView to_view(const std::optional<nb::ndarray<>>& array, const char* name);

// Fills the fields every op's params struct shares: the layout, the query and
// key cu_seqlens and the thread count.
template <class Params>
void set_sequence_params(Params& p, std::vector<std::int64_t> cu_seqlens_q,
                         std::vector<std::int64_t> cu_seqlens_k, const std::string& layout,
                         int num_threads) {
  p.layout = parse_layout(layout);
  p.cu_seqlens_q = std::move(cu_seqlens_q);
  p.cu_seqlens_k = std::move(cu_seqlens_k);
  p.num_threads = num_threads;
}

// A paged cache's layout from the Python arguments every decode op takes.
inline CacheLayout make_cache_layout(std::int64_t dim, std::int64_t rope_dim, const std::string& cache_dtype,
                                     bool ring) {
  CacheLayout l;
  l.dtype = parse_cache_dtype(cache_dtype.c_str());
  l.dim = dim;
  l.rope_dim = rope_dim;
  l.ring = ring;
  return l;
}

// Registers one op family's functions; each lives in its own file.
void register_core(nb::module_& m);
void register_indexer(nb::module_& m);
void register_kl_loss(nb::module_& m);
void register_compressor(nb::module_& m);
void register_openmp_runner(nb::module_& m);
void register_paged_cache(nb::module_& m);
void register_decode(nb::module_& m);
void register_sparse_attention(nb::module_& m);

}  // namespace dsa::python
