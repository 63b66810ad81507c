// AMX-BF16 kernels of the sparse KL loss (bf16 inputs): the algorithm of
// kl_sparse_pairs.h with its products on AMX tiles.
#define DSA_KL_SPARSE_KERNELS amx_sparse_kernels
#define DSA_KL_LABEL "amx"
#include "cpu/kl_loss/kl_sparse_pairs.h"

#include "cpu/isa/amx.h"

namespace dsa::cpu::kl_kernels {
namespace {

void configure_tiles() { ::dsa::cpu::amx::configure_tiles(); }
void release_tiles() { _tile_release(); }

// C tiles 0-3 (entries 0-15 / 16-31 x the pair's two head groups), A tiles 4-5, B tiles 6-7.
template <class Epilogue>
void block_gemm(const std::uint16_t* a, int64_t chunks, const std::uint32_t* b, int64_t groups, float* cbuf,
                const Epilogue& epilogue) {
  const int stride = static_cast<int>(chunks * kChunk * 2);
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, a + c * kChunk, stride);
      _tile_loadd(5, a + 16 * chunks * kChunk + c * kChunk, stride);
      _tile_loadd(6, b + (c * groups + g) * 256, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (pair) {
        _tile_loadd(7, b + (c * groups + g + 1) * 256, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    // cbuf: [group in pair][32 entries][16 heads]
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    epilogue(g, cbuf);
    if (pair) {
      _tile_stored(2, cbuf + 512, 64);
      _tile_stored(3, cbuf + 768, 64);
      epilogue(g + 1, cbuf + 512);
    }
  }
}

// dQ[16 heads][16 dims] tiles accumulate through the fp32 row buffer.
void dq_update(float* dqacc, int64_t idim, const std::uint16_t* adq, const std::uint32_t* bdq, int64_t igroups,
               int64_t dgroups) {
  const int dq_stride = static_cast<int>(idim * 4);
  for (int64_t dg = 0; dg < dgroups; ++dg) {
    _tile_loadd(6, bdq + dg * 256, 64);
    for (int64_t hg = 0; hg < igroups; ++hg) {
      float* cp = dqacc + hg * 16 * idim + dg * 16;
      _tile_loadd(0, cp, dq_stride);
      _tile_loadd(4, adq + hg * 16 * 32, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_stored(0, cp, dq_stride);
    }
  }
}

void dk_contrib(float* contrib, int64_t idim, const std::uint16_t* adk, const std::uint32_t* ih, int64_t ihc,
                int64_t dgroups) {
  const int dq_stride = static_cast<int>(idim * 4);
  for (int64_t eb = 0; eb < 2; ++eb)
    for (int64_t dg = 0; dg < dgroups; ++dg) {
      _tile_zero(0);
      for (int64_t hc = 0; hc < ihc; ++hc) {
        _tile_loadd(4, adk + (hc * 32 + eb * 16) * 32, 64);
        _tile_loadd(6, ih + (hc * dgroups + dg) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, contrib + eb * 16 * idim + dg * 16, dq_stride);
    }
}

}  // namespace
}  // namespace dsa::cpu::kl_kernels
