// AVX-512 pooling kernels: 16 channels per vector, up to four vectors (a
// 64-channel strip) in flight so the max / sum / weighted-sum chains overlap.
// GCC 12 flags the self-initialised `_mm512_undefined_*` inside its own
// masked-intrinsic wrappers (a false positive of the header, not of this code).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "cpu/compressor/pool_kernels.h"


namespace dsa::cpu::compressor_kernels {
namespace {

inline __mmask16 lane_mask(std::int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

template <DType T>
inline __m512 load(const void* base, std::int64_t at, __mmask16 mask) {
  if constexpr (T == DType::f32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(base) + at);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const std::uint16_t*>(base) + at);
    if constexpr (T == DType::bf16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);
  }
}

template <DType T>
inline void store(void* base, std::int64_t at, __m512 v, __mmask16 mask) {
  if constexpr (T == DType::f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(base) + at, mask, v);
  } else {
    __m256i h;
    if constexpr (T == DType::bf16) {
      // Round to nearest even; NaN stays a quiet NaN.
      const __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const __m512i rounded =
          _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
    } else {
      h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(base) + at, mask, h);
  }
}

// exp(x) for x <= 0 (and NaN): 2^n * p(r), |r| <= ln2/2, degree-6 polynomial
// (relative error ~2e-7). -inf and very negative x give 0, NaN stays NaN.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // second operand wins on NaN: keeps NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// A channel whose logits are all -inf pools nothing: weights 0, not NaN.
inline __m512 safe_max(__m512 max) {
  const __mmask16 empty = _mm512_cmp_ps_mask(max, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(max, empty, _mm512_setzero_ps());
}

template <DType T, int NV>
void forward_strip(const PoolArgs& a, std::int64_t c0, const __mmask16 (&mask)[4]) {
  __m512 max[NV], sum[NV], acc[NV];
  for (int v = 0; v < NV; ++v) max[v] = _mm512_set1_ps(-__builtin_inff());
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const SlotRef& s = a.slots[i];
    for (int v = 0; v < NV; ++v) {
      const std::int64_t at = c0 + 16 * v;
      const __m512 l = _mm512_add_ps(load<T>(s.gate, at, mask[v]), _mm512_maskz_loadu_ps(mask[v], s.bias + at));
      max[v] = _mm512_max_ps(max[v], l);
    }
  }
  for (int v = 0; v < NV; ++v) {
    max[v] = safe_max(max[v]);
    sum[v] = _mm512_setzero_ps();
    acc[v] = _mm512_setzero_ps();
  }
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const SlotRef& s = a.slots[i];
    for (int v = 0; v < NV; ++v) {
      const std::int64_t at = c0 + 16 * v;
      const __m512 l = _mm512_add_ps(load<T>(s.gate, at, mask[v]), _mm512_maskz_loadu_ps(mask[v], s.bias + at));
      const __m512 e = exp_nonpositive(_mm512_sub_ps(l, max[v]));
      sum[v] = _mm512_add_ps(sum[v], e);
      acc[v] = _mm512_fmadd_ps(e, load<T>(s.kv, at, mask[v]), acc[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __mmask16 positive = _mm512_cmp_ps_mask(sum[v], _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 inv = _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0f), sum[v]);
    store<T>(a.out, c0 + 16 * v, _mm512_mul_ps(acc[v], inv), mask[v]);
  }
}

template <DType T, int NV>
void backward_strip(const PoolArgs& a, std::int64_t c0, const __mmask16 (&mask)[4]) {
  __m512 max[NV], sum[NV], acc[NV];
  for (int v = 0; v < NV; ++v) max[v] = _mm512_set1_ps(-__builtin_inff());
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const SlotRef& s = a.slots[i];
    for (int v = 0; v < NV; ++v) {
      const std::int64_t at = c0 + 16 * v;
      const __m512 l = _mm512_add_ps(load<T>(s.gate, at, mask[v]), _mm512_maskz_loadu_ps(mask[v], s.bias + at));
      max[v] = _mm512_max_ps(max[v], l);
    }
  }
  for (int v = 0; v < NV; ++v) {
    max[v] = safe_max(max[v]);
    sum[v] = _mm512_setzero_ps();
    acc[v] = _mm512_setzero_ps();
  }
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const SlotRef& s = a.slots[i];
    float* e_row = a.scratch + i * kStripWidth;
    for (int v = 0; v < NV; ++v) {
      const std::int64_t at = c0 + 16 * v;
      const __m512 l = _mm512_add_ps(load<T>(s.gate, at, mask[v]), _mm512_maskz_loadu_ps(mask[v], s.bias + at));
      const __m512 e = exp_nonpositive(_mm512_sub_ps(l, max[v]));
      _mm512_store_ps(e_row + 16 * v, e);
      sum[v] = _mm512_add_ps(sum[v], e);
      acc[v] = _mm512_fmadd_ps(e, load<T>(s.kv, at, mask[v]), acc[v]);
    }
  }
  __m512 out[NV], g_inv[NV];
  for (int v = 0; v < NV; ++v) {
    const __mmask16 positive = _mm512_cmp_ps_mask(sum[v], _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 inv = _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0f), sum[v]);
    out[v] = _mm512_mul_ps(acc[v], inv);
    g_inv[v] = _mm512_mul_ps(load<T>(a.grad_out, c0 + 16 * v, mask[v]), inv);
  }
  // d kv_i = p_i g;  d logit_i = p_i g (kv_i - out).
  for (std::int64_t i = 0; i < a.slot_count; ++i) {
    const SlotRef& s = a.slots[i];
    const float* e_row = a.scratch + i * kStripWidth;
    for (int v = 0; v < NV; ++v) {
      const std::int64_t at = c0 + 16 * v;
      const __m512 pg = _mm512_mul_ps(_mm512_load_ps(e_row + 16 * v), g_inv[v]);
      const __m512 grad_logit = _mm512_mul_ps(pg, _mm512_sub_ps(load<T>(s.kv, at, mask[v]), out[v]));
      store<T>(s.grad_kv, at, pg, mask[v]);
      store<T>(s.grad_gate, at, grad_logit, mask[v]);
      _mm512_mask_storeu_ps(s.bias_partial + at, mask[v],
                            _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], s.bias_partial + at), grad_logit));
    }
  }
}

template <DType T, bool Backward>
void run(const PoolArgs& a) {
  for (std::int64_t c0 = 0; c0 < a.width; c0 += kStripWidth) {
    const std::int64_t n = a.width - c0 < kStripWidth ? a.width - c0 : kStripWidth;
    const __mmask16 mask[4] = {lane_mask(n), lane_mask(n - 16), lane_mask(n - 32), lane_mask(n - 48)};
    const int vectors = static_cast<int>((n + 15) / 16);
    auto strip = [&]<int NV>() {
      if constexpr (Backward) backward_strip<T, NV>(a, c0, mask);
      else forward_strip<T, NV>(a, c0, mask);
    };
    switch (vectors) {
      case 4: strip.template operator()<4>(); break;
      case 3: strip.template operator()<3>(); break;
      case 2: strip.template operator()<2>(); break;
      default: strip.template operator()<1>(); break;
    }
  }
}

template <bool Backward>
void dispatch(const PoolArgs& a) {
  switch (a.dtype) {
    case DType::bf16: run<DType::bf16, Backward>(a); break;
    case DType::f16: run<DType::f16, Backward>(a); break;
    default: run<DType::f32, Backward>(a); break;
  }
}

}  // namespace

const PoolKernel& avx512_kernel() {
  static const PoolKernel kernel{"avx512", dispatch<false>, dispatch<true>};
  return kernel;
}

}  // namespace dsa::cpu::compressor_kernels
