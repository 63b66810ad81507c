// Portable (scalar) pooling kernels: the fallback for CPUs without AVX-512.
#include <algorithm>
#include <cmath>

#include "core/numeric.h"
#include "cpu/compressor/pool_kernels.h"

namespace dsa::cpu::compressor_kernels {
namespace {

using core::load_float;
using core::store_float;

inline float logit(const PoolArgs& a, std::int64_t i, std::int64_t ch) {
  return load_float(a.slots[i].gate, a.dtype, ch) + a.slots[i].bias[ch];
}

// A channel whose logits are all -inf pools nothing: weights 0, not NaN.
inline float safe_max(float max) { return max == core::kNegInf ? 0.0f : max; }

// 1 / sum where sum > 0, 0 for such a channel's sum of 0, and NaN for a NaN
// sum: a NaN logit (std::max above skips it) must reach the outputs, as in
// the reference and the vector kernels, not turn them into zeros.
inline float safe_reciprocal(float sum) { return sum > 0.0f ? 1.0f / sum : std::isnan(sum) ? sum : 0.0f; }

void forward(const PoolArgs& a) {
  for (std::int64_t ch = 0; ch < a.width; ++ch) {
    float max = core::kNegInf;
    for (std::int64_t i = 0; i < a.slot_count; ++i) max = std::max(max, logit(a, i, ch));
    max = safe_max(max);
    float sum = 0.0f, acc = 0.0f;
    for (std::int64_t i = 0; i < a.slot_count; ++i) {
      const float e = std::exp(logit(a, i, ch) - max);
      sum += e;
      acc += e * load_float(a.slots[i].kv, a.dtype, ch);
    }
    const float inv = safe_reciprocal(sum);
    store_float(a.out, a.dtype, ch, acc * inv);
    if (a.stats) {
      a.stats[ch] = max;
      a.stats[a.stats_stride + ch] = inv;
      a.stats[2 * a.stats_stride + ch] = acc * inv;
    }
  }
}

void backward(const PoolArgs& a) {
  float* e = a.scratch;
  for (std::int64_t ch = 0; ch < a.width; ++ch) {
    float max = core::kNegInf;
    for (std::int64_t i = 0; i < a.slot_count; ++i) max = std::max(max, logit(a, i, ch));
    max = safe_max(max);
    float sum = 0.0f, acc = 0.0f;
    for (std::int64_t i = 0; i < a.slot_count; ++i) {
      e[i] = std::exp(logit(a, i, ch) - max);
      sum += e[i];
      acc += e[i] * load_float(a.slots[i].kv, a.dtype, ch);
    }
    const float inv = safe_reciprocal(sum);
    const float out = acc * inv;
    const float g_inv = load_float(a.grad_out, a.dtype, ch) * inv;
    for (std::int64_t i = 0; i < a.slot_count; ++i) {
      const SlotRef& s = a.slots[i];
      const float pg = e[i] * g_inv;  // p_i * g
      const float grad_logit = pg * (load_float(s.kv, a.dtype, ch) - out);
      store_float(s.grad_kv, a.dtype, ch, pg);
      store_float(s.grad_gate, a.dtype, ch, grad_logit);
      s.bias_partial[ch] += grad_logit;
    }
  }
}

// Each slot's weight straight from its logit and the saved max and 1 / sum.
void backward_from_stats(const PoolArgs& a) {
  const float* max = a.stats;
  const float* inv = a.stats + a.stats_stride;
  const float* out = a.stats + 2 * a.stats_stride;
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const SlotRef& s = a.slots[i];
    for (std::int64_t ch = 0; ch < a.width; ++ch) {
      const float pg = std::exp(logit(a, i, ch) - max[ch]) * inv[ch] * load_float(a.grad_out, a.dtype, ch);
      const float grad_logit = pg * (load_float(s.kv, a.dtype, ch) - out[ch]);
      store_float(s.grad_kv, a.dtype, ch, pg);
      store_float(s.grad_gate, a.dtype, ch, grad_logit);
      s.bias_partial[ch] += grad_logit;
    }
  }
}

}  // namespace

const PoolKernel& portable_kernel() {
  static const PoolKernel kernel{"portable", forward, backward, backward_from_stats};
  return kernel;
}

}  // namespace dsa::cpu::compressor_kernels
