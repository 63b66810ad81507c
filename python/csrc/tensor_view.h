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

// Registers one op family's functions; each lives in its own file.
void register_core(nb::module_& m);
void register_indexer(nb::module_& m);
void register_kl_loss(nb::module_& m);
void register_compressor(nb::module_& m);
void register_sparse_attention(nb::module_& m);

}  // namespace dsa::python
