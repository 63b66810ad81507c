// Argument validation at the API boundary. Every message names the argument,
// what was expected and what was given. Never used inside hot loops.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>

#include "dsa/error.h"
#include "dsa/tensor.h"

namespace dsa::core {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

template <class... Parts>
[[noreturn]] void fail_argument(const Parts&... parts) {
  throw Error(ErrorKind::invalid_argument, concat(parts...));
}

template <class... Parts>
[[noreturn]] void fail_unsupported(const Parts&... parts) {
  throw Error(ErrorKind::unsupported, concat(parts...));
}

std::string shape_string(const TensorView& t);

void require_present(const TensorView& t, const char* name);
// What any view must be, whatever its op: at most kMaxDims dims, no negative
// size, and an element count (also that of its non-zero sizes alone) and a
// byte extent that fit in int64. A hand-made
// view can claim anything, and the kernels compute offsets as index * stride
// and size buffers from the shape, so such a view would wrap an offset or ask
// for an impossible allocation instead of failing. Absent views pass.
void require_addressable(const TensorView& t, const char* name);
// Also runs require_addressable: every op checks each view it touches here
// first, before it reads the view's shape.
void require_cpu(const TensorView& t, const char* name);
void require_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
void require_ndim(const TensorView& t, const char* name, std::initializer_list<int> allowed,
                  const char* expected_shape);
void require_size(const TensorView& t, const char* name, int dim, std::int64_t expected,
                  const char* what);
void require_last_dim_contiguous(const TensorView& t, const char* name);
// BSND tensors: the kernels address row b * S + s at one row stride, so dims 0
// and 1 must merge. Trivially true with one batch row or S = 0 (a property test
// found a BSND call with Sq = 0 rejected: torch gives such a tensor stride(0) != 0).
void require_mergeable_rows(const TensorView& t, const char* name);
void require_contiguous(const TensorView& t, const char* name);

// query_rope beside query: each row holds D + Dr values, a sum the kernels
// take first; both sizes can be valid (an empty tensor's dims are bounded by
// no memory) while the sum overflows int64 (found by fuzz_kl_loss).
void require_rope_dim_fits(std::int64_t dim, std::int64_t rope_dim);

// A caller-allocated tensor of a known shape (an output, saved statistics, a
// state): present, CPU, `dtype`, exactly the shape of `like` (named
// `expected_shape` in the error), contiguous unless empty.
void require_output(const TensorView& t, const char* name, DType dtype, const TensorView& like,
                    const char* expected_shape);
// A shape-only view for require_output's `like`.
TensorView shape_like(std::initializer_list<std::int64_t> shape);

// A floating tensor (bf16/fp16/fp32) on the CPU with a unit-stride last dim.
void require_float_input(const TensorView& t, const char* name, std::initializer_list<int> ndims,
                         const char* expected_shape);

}  // namespace dsa::core
