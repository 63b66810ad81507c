#include "core/validate.h"

#include <limits>

namespace dsa::core {

std::string shape_string(const TensorView& t) {
  if (!t.present()) return "absent";
  // A hand-made view may claim more dims than it can hold: say so, read no further.
  if (t.ndim > kMaxDims) return std::to_string(t.ndim) + " dims (at most " + std::to_string(kMaxDims) + ")";
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < t.ndim; ++d) os << (d ? ", " : "") << t.shape[d];
  os << "]";
  return os.str();
}

void require_present(const TensorView& t, const char* name) {
  if (!t.present()) fail_argument(name, ": expected a tensor, got None");
}

void require_addressable(const TensorView& t, const char* name) {
  if (!t.present()) return;
  if (t.ndim > kMaxDims) fail_argument(name, ": expected at most ", kMaxDims, " dims, got ", t.ndim);
  // The product of the non-zero sizes, too, must fit: the ops multiply sizes
  // (row sizes, contiguity checks) before they look for an empty dim, so
  // [0, 3, INT64_MAX] overflowed in is_contiguous (found by fuzz_sparse_attention).
  std::int64_t numel = 1, nonzero = 1;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) fail_argument(name, ": dim ", d, " has a negative size in shape ", shape_string(t));
    if (__builtin_mul_overflow(nonzero, t.shape[d] > 0 ? t.shape[d] : 1, &nonzero))
      fail_argument(name, ": the number of elements of shape ", shape_string(t), " overflows int64");
    numel *= t.shape[d];  // <= nonzero
  }
  if (numel == 0) return;  // nothing is addressed, whatever the strides say
  std::int64_t last = 0;  // offset of the farthest element, in elements
  for (int d = 0; d < t.ndim; ++d) {
    const std::int64_t stride = t.strides[d] < 0 ? -t.strides[d] : t.strides[d];
    std::int64_t span;
    if (t.strides[d] == std::numeric_limits<std::int64_t>::min() ||
        __builtin_mul_overflow(t.shape[d] - 1, stride, &span) || __builtin_add_overflow(last, span, &last))
      fail_argument(name, ": stride ", t.strides[d], " of dim ", d, " in shape ", shape_string(t),
                    " addresses offsets beyond int64");
  }
  std::int64_t bytes;
  if (__builtin_mul_overflow(last + 1, static_cast<std::int64_t>(dtype_size(t.dtype)), &bytes))
    fail_argument(name, ": shape ", shape_string(t), " with its strides addresses more bytes than int64 holds");
}

void require_cpu(const TensorView& t, const char* name) {
  require_addressable(t, name);
  if (t.device != Device::cpu)
    fail_argument(name, ": expected a CPU tensor for this backend, got a ", device_name(t.device),
                  " tensor");
}

void require_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::ostringstream os;
  bool first = true;
  for (DType d : allowed) {
    os << (first ? "" : " or ") << dtype_name(d);
    first = false;
  }
  fail_argument(name, ": expected dtype ", os.str(), ", got ", dtype_name(t.dtype));
}

void require_ndim(const TensorView& t, const char* name, std::initializer_list<int> allowed,
                  const char* expected_shape) {
  for (int n : allowed)
    if (t.ndim == n) return;
  fail_argument(name, ": expected shape ", expected_shape, ", got ", shape_string(t));
}

void require_size(const TensorView& t, const char* name, int dim, std::int64_t expected,
                  const char* what) {
  if (t.size(dim) != expected)
    fail_argument(name, ": expected size ", expected, " (", what, ") in dim ", dim, ", got shape ",
                  shape_string(t));
}

void require_mergeable_rows(const TensorView& t, const char* name) {
  if (t.size(0) > 1 && t.size(1) > 0 && t.stride(0) != t.size(1) * t.stride(1))
    fail_argument(name, ": the batch and sequence dims must be mergeable (contiguous rows)");
}

void require_last_dim_contiguous(const TensorView& t, const char* name) {
  // An empty tensor is never read, so its strides do not matter (torch expands a
  // 0-row gradient with stride 0, and .contiguous() keeps it as it is).
  if (t.ndim > 0 && t.numel() > 0 && t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1)
    fail_argument(name, ": expected a contiguous last dimension, got stride ",
                  t.strides[t.ndim - 1]);
}

void require_contiguous(const TensorView& t, const char* name) {
  if (!t.is_contiguous()) fail_argument(name, ": expected a contiguous tensor");
}

void require_rope_dim_fits(std::int64_t dim, std::int64_t rope_dim) {
  std::int64_t sum;
  if (__builtin_add_overflow(dim, rope_dim, &sum))
    fail_argument("query_rope: D + Dr = ", dim, " + ", rope_dim, " overflows int64");
}

void require_output(const TensorView& t, const char* name, DType dtype, const TensorView& like,
                    const char* expected_shape) {
  require_present(t, name);
  require_cpu(t, name);
  require_dtype(t, name, {dtype});
  bool same = t.ndim == like.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == like.shape[d];
  if (!same)
    fail_argument(name, ": expected shape ", expected_shape, " = ", shape_string(like), ", got ", shape_string(t));
  if (t.numel() > 0) require_contiguous(t, name);  // empty tensors carry arbitrary strides
}

TensorView shape_like(std::initializer_list<std::int64_t> shape) {
  TensorView v;
  v.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (auto s : shape) v.shape[d++] = s;
  return v;
}

void require_float_input(const TensorView& t, const char* name, std::initializer_list<int> ndims,
                         const char* expected_shape) {
  require_present(t, name);
  require_cpu(t, name);
  require_ndim(t, name, ndims, expected_shape);
  require_dtype(t, name, {DType::bf16, DType::f16, DType::f32});
  require_last_dim_contiguous(t, name);
}

}  // namespace dsa::core
