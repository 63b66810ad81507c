#include "dsa/tensor.h"

#include "core/validate.h"

namespace dsa {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}

const char* device_name(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

TensorView make_view(void* data, DType dtype, std::span<const std::int64_t> shape, Device device) {
  if (shape.size() > static_cast<std::size_t>(kMaxDims))
    core::fail_argument("shape: at most ", kMaxDims, " dims, got ", shape.size());
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    if (shape[d] < 0) core::fail_argument("shape: dim ", d, " is negative (", shape[d], ")");
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
  return v;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape, Device device) {
  return make_view(data, dtype, std::span<const std::int64_t>(shape.begin(), shape.size()), device);
}

}  // namespace dsa
