// Non-owning tensor views: the only way tensors cross the dsa API.
// The core never sees a framework type; bindings translate into these views.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>

namespace dsa {

// u8: raw bytes, the storage of paged caches (dsa/paged_cache.h).
enum class DType : int { f32, bf16, f16, i32, i64, u8 };
enum class Device : int { cpu, cuda };

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);
const char* device_name(Device device);

inline constexpr int kMaxDims = 6;

// A strided, non-owning view. Strides are in elements. A default-constructed
// view is "absent" (ndim == -1), which is how optional arguments are passed.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = -1;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t strides[kMaxDims] = {};

  bool present() const { return ndim >= 0; }
  std::int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  std::int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= shape[d];
    return n;
  }
  bool is_contiguous() const {
    // As in torch, an empty tensor is contiguous whatever its strides: it has no
    // element to misplace (a property test found BSND outputs with Sq = 0, whose
    // torch strides fail the walk below, rejected).
    if (numel() == 0) return true;
    std::int64_t expected = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      if (shape[d] != 1 && strides[d] != expected) return false;
      expected *= shape[d];
    }
    return true;
  }
  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
};

// A contiguous view over caller memory (at most kMaxDims dims, each >= 0;
// dsa::Error otherwise).
TensorView make_view(void* data, DType dtype, std::span<const std::int64_t> shape, Device device = Device::cpu);
TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     Device device = Device::cpu);

}  // namespace dsa
