// AMX-BF16 kernels of the dense indexer KL loss (bf16 inputs): the algorithm of
// dense_kl_pairs.h with its products on AMX tiles.
#define DSA_KL_DENSE_KERNELS amx_dense_kernels
#define DSA_KL_LABEL "amx"
#include "cpu/dense_indexer/dense_kl_pairs.h"

#include "cpu/isa/amx.h"

namespace dsa::cpu::kl_kernels {
namespace {

void configure_tiles() { ::dsa::cpu::amx::configure_tiles(); }
void release_tiles() { _tile_release(); }

// C tiles 0-3 (keys 0-15 / 16-31 x tokens 0-15 / 16-31), A tiles 4-5, B tiles 6-7.
void tile_gemm_32x32(const ATiles& a, const std::uint32_t* b, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t ch = 0; ch < a.chunks; ++ch) {
    const long stride = static_cast<long>(a.stride[ch] * 2);
    _tile_loadd(4, a.ptr[ch], stride);
    _tile_loadd(5, a.ptr[ch] + 16 * a.stride[ch], stride);
    _tile_loadd(6, b + ch * 512, 64);
    _tile_loadd(7, b + ch * 512 + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

// Each C tile pair is loaded once, takes `count` products, and is stored once.
void dq_flush(float* dqt, const std::uint16_t* ikt, const std::uint32_t* cvnni, int64_t iheads, int64_t idim,
              int64_t count) {
  constexpr int64_t kWide = kDqTiles * kTk;
  const int64_t dgroups = idim / 16;
  for (int64_t j = 0; j < iheads; ++j) {
    float* cj = dqt + j * idim * kTq;
    const std::uint32_t* bj = cvnni + j * kDqTiles * 512;
    for (int64_t dg = 0; dg < dgroups; ++dg) {
      _tile_loadd(0, cj + dg * 16 * kTq, 128);
      _tile_loadd(1, cj + dg * 16 * kTq + 16, 128);
      for (int64_t u = 0; u < count; ++u) {
        _tile_loadd(4, ikt + dg * 16 * kWide + u * kTk, kWide * 2);
        _tile_loadd(6, bj + u * 512, 64);
        _tile_loadd(7, bj + u * 512 + 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, cj + dg * 16 * kTq, 128);
      _tile_stored(1, cj + dg * 16 * kTq + 16, 128);
    }
  }
}

void dk_update(float* dk, int64_t idim, const std::uint16_t* coef, const std::uint32_t* ivnni, int64_t iheads) {
  const int64_t dgroups = idim / 16;
  const long dk_stride = static_cast<long>(idim * 4);
  for (int64_t kg = 0; kg < 2; ++kg)
    for (int64_t dg = 0; dg < dgroups; dg += 2) {
      float* c = dk + kg * 16 * idim + dg * 16;
      _tile_loadd(0, c, dk_stride);
      _tile_loadd(1, c + 16, dk_stride);
      for (int64_t j = 0; j < iheads; ++j) {
        _tile_loadd(4, coef + (j * kTk + kg * 16) * kTq, 64);
        _tile_loadd(6, ivnni + (j * dgroups + dg) * 256, 64);
        _tile_loadd(7, ivnni + (j * dgroups + dg + 1) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, c, dk_stride);
      _tile_stored(1, c + 16, dk_stride);
    }
}

}  // namespace
}  // namespace dsa::cpu::kl_kernels
