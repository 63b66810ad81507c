#include "tensor_view.h"

namespace dsa::python {

TensorView to_view(const nb::ndarray<>& a, const char* name) {
  TensorView v;
  v.data = a.data();
  v.ndim = static_cast<int>(a.ndim());
  if (v.ndim > kMaxDims)
    throw Error(ErrorKind::invalid_argument,
                std::string(name) + ": at most " + std::to_string(kMaxDims) + " dims are supported");
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = a.shape(d);
    v.strides[d] = a.stride(d);
  }
  v.device = a.device_type() == nb::device::cuda::value ? Device::cuda : Device::cpu;
  const auto dt = a.dtype();
  using code = nb::dlpack::dtype_code;
  if (dt.lanes == 1 && dt.code == static_cast<std::uint8_t>(code::Float) && dt.bits == 32) v.dtype = DType::f32;
  else if (dt.lanes == 1 && dt.code == static_cast<std::uint8_t>(code::Float) && dt.bits == 16) v.dtype = DType::f16;
  else if (dt.lanes == 1 && dt.code == static_cast<std::uint8_t>(code::Bfloat) && dt.bits == 16) v.dtype = DType::bf16;
  else if (dt.lanes == 1 && dt.code == static_cast<std::uint8_t>(code::Int) && dt.bits == 32) v.dtype = DType::i32;
  else if (dt.lanes == 1 && dt.code == static_cast<std::uint8_t>(code::Int) && dt.bits == 64) v.dtype = DType::i64;
  else if (dt.lanes == 1 && dt.code == static_cast<std::uint8_t>(code::UInt) && dt.bits == 8) v.dtype = DType::u8;
  else
    throw Error(ErrorKind::invalid_argument,
                std::string(name) + ": unsupported dtype (expected float32, bfloat16, float16, int32, int64 or uint8)");
  return v;
}

TensorView to_view(const std::optional<nb::ndarray<>>& a, const char* name) {
  return a ? to_view(*a, name) : TensorView{};
}

void register_core(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(e.kind() == ErrorKind::invalid_argument ? PyExc_ValueError : PyExc_RuntimeError,
                      e.what());
    }
  });
  m.def("backends", [] {
    nb::list out;
    for (const auto& b : dsa::backends()) {
      nb::dict d;
      d["name"] = b.name;
      d["built"] = b.built;
      d["works"] = b.works;
      d["detail"] = b.detail;
      out.append(d);
    }
    return out;
  });
  m.def("cpu_isa", &dsa::cpu_isa_name);
  m.def("default_num_threads", &dsa::default_num_threads);
  m.def("set_workspace_cache_limit", [](std::size_t bytes) { dsa::set_workspace_cache_limit(bytes); });
  m.def("workspace_cache_limit", &dsa::workspace_cache_limit);
  m.def("workspace_cache_bytes", &dsa::workspace_cache_bytes);
  m.def("release_workspace_cache", &dsa::release_workspace_cache);
  // The allocation-failure test hook (dsa/backend.h): a cap on dsa's own allocator.
  m.def("set_scratch_memory_limit", [](std::size_t bytes) { dsa::set_scratch_memory_limit(bytes); });
  m.def("scratch_memory_limit", &dsa::scratch_memory_limit);
  m.def("scratch_memory_bytes", &dsa::scratch_memory_bytes);
  // dsa's own arithmetic peaks (include/dsa/peak.h), for the benchmark's ceilings.
  m.def("peak_kernels", [] {
    nb::list out;
    for (auto k : dsa::supported_peak_kernels()) out.append(std::string(dsa::peak_kernel_name(k)));
    return out;
  });
  m.def("measure_peak_flops", [](const std::string& kernel, int num_threads, double seconds) {
    const auto k = dsa::parse_peak_kernel(kernel);
    nb::gil_scoped_release release;  // a few hundred ms of pure C++
    return dsa::measure_peak_flops(k, num_threads, seconds);
  }, nb::arg("kernel"), nb::arg("num_threads") = 0, nb::arg("seconds") = 0.2);
}

}  // namespace dsa::python

NB_MODULE(_C, m) {
  m.doc() = "dsa C++ core bindings (internal; use the dsa package)";
  dsa::python::register_core(m);
  dsa::python::register_indexer(m);
  dsa::python::register_kl_loss(m);
  dsa::python::register_compressor(m);
  dsa::python::register_openmp_runner(m);
  dsa::python::register_paged_cache(m);
  dsa::python::register_decode(m);
  dsa::python::register_sparse_attention(m);
}
