// Fused CPU dense indexer (spec 4.4, the dense warm-up): the indexer's
// log-sum-exp over every visible key, on the lightning indexer's score kernels
// (cpu/score/) with an online log-sum-exp per row, and the selection of the
// dense KL kernels.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/memory.h"
#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/dense_indexer/dense_kl_kernels.h"
#include "cpu/score/score_kernels.h"
#include "cpu/select.h"

namespace dsa::cpu {
namespace {

using namespace kl_kernels;
using core::Isa;

// Candidates, best first (cpu/select.h): for bf16 the pair kernels with AMX
// tiles (dense_kl_amx.cpp) or the same kernels on vdpbf16ps
// (dense_kl_avx512bf16.cpp), for the problems their tiles take; otherwise the
// generic ones.
constexpr Candidate<DenseKlKernels, DenseKlProblem> kDense[] = {
    {Isa::amx, amx_dense_kernels, pair_dense_supported},
    {Isa::avx512_bf16, avx512_bf16_dense_kernels, pair_dense_supported},
    {Isa::avx512, avx512_dense_kernels},
    {Isa::avx2, avx2_dense_kernels},
    {Isa::portable, portable_dense_kernels},
};

}  // namespace

void dense_indexer_kl_loss_fwd(const DenseKlProblem& p) { select_kernel(kDense, p).fwd(p); }
void dense_indexer_kl_loss_bwd(const DenseKlProblem& p) { select_kernel(kDense, p).bwd(p); }

void dense_indexer_lse(const DenseLseProblem& p) {
  using namespace indexer_kernels;
  const ScoreKernel& kernel = pick_score_kernel(p.index_query.dtype);
  std::fill(p.lse, p.lse + p.plan.q_rows, core::kPosInf);
  const std::vector<core::QueryBlock> tasks = core::query_blocks(
      p.plan, kQueryBlock, [&](const core::SequenceSlice& seq, std::int64_t first, std::int64_t tokens) {
        return tokens * (visible_compressed(seq.position(first + tokens - 1), p.ratio) + 1);
      });
  const int threads = std::max(1, std::min<int>(p.num_threads, static_cast<int>(tasks.size())));
  const HeadMatrix& iq = p.index_query;
  struct Scratch {
    core::ScratchVector<std::uint8_t> packed, key_scratch;  // dsa's allocator: failures name the size
    std::vector<float> weights, tile;
  };
  // No buffers without tasks: with no query rows Hi and Di are bounded by no
  // memory (as in the KL kernels).
  std::vector<Scratch> scratch(tasks.empty() ? 0 : threads);
  for (auto& s : scratch) {
    s.packed.resize(kernel.packed_query_bytes(iq.heads, iq.dim) + 64);
    s.key_scratch.resize(kernel.key_scratch_bytes(iq.dim) + 64);
    s.weights.resize(kQueryBlock * iq.heads);
    s.tile.resize(kQueryBlock * kKeyTile);
  }
  auto aligned = [](core::ScratchVector<std::uint8_t>& v) {
    return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(v.data()) + 63) & ~std::uintptr_t(63));
  };
  core::parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t task_index, int thread) {
    const core::QueryBlock& task = tasks[task_index];
    const auto& seq = p.plan.seqs[task.seq];
    Scratch& s = scratch[thread];
    const std::int64_t row0 = seq.q_begin + task.first;
    QueryBlockSource block{iq.bytes(row0, 0), iq.dtype, iq.row_stride, iq.head_stride, task.tokens, iq.heads, iq.dim};
    void* packed = aligned(s.packed);
    kernel.pack_queries(block, packed);
    for (std::int64_t t = 0; t < task.tokens; ++t)
      for (std::int64_t h = 0; h < iq.heads; ++h)
        s.weights[t * iq.heads + h] = p.scale * p.weights.at(row0 + t, h, 0);
    // Online log-sum-exp: running max and the sum of exp(score - max), in key order.
    float running_max[kQueryBlock], running_sum[kQueryBlock];
    std::int64_t visible[kQueryBlock] = {};  // task.tokens >= 1, but GCC 12 cannot see it
    for (std::int64_t t = 0; t < task.tokens; ++t) {
      running_max[t] = core::kNegInf;
      running_sum[t] = 0.0f;
      visible[t] = visible_compressed(seq.position(task.first + t), p.ratio);
    }
    const std::int64_t last = visible[task.tokens - 1];
    for (std::int64_t k0 = 0; k0 < last; k0 += kKeyTile) {
      const std::int64_t n = std::min(kKeyTile, last - k0);
      KeyTileSource keys{p.index_key.bytes(seq.c_begin + k0, 0), p.index_key.dtype, p.index_key.row_stride, n};
      kernel.score_tile(packed, block, s.weights.data(), keys, aligned(s.key_scratch), s.tile.data());
      for (std::int64_t t = 0; t < task.tokens; ++t) {
        const std::int64_t count = std::min(n, visible[t] - k0);
        if (count <= 0) continue;
        const float* score = s.tile.data() + t * kKeyTile;
        float tile_max = core::kNegInf;
        for (std::int64_t j = 0; j < count; ++j) tile_max = std::max(tile_max, score[j]);
        const float new_max = std::max(running_max[t], tile_max);
        if (!(new_max > core::kNegInf)) {
          // No score above -inf (NaN leaves the max): NaN scores make the row's lse
          // NaN, as in the reference's sum of exp(score - max).
          for (std::int64_t j = 0; j < count; ++j)
            if (std::isnan(score[j])) running_sum[t] = score[j];
          continue;
        }
        float sum = running_sum[t] * (running_sum[t] > 0.0f ? std::exp(running_max[t] - new_max) : 0.0f);
        for (std::int64_t j = 0; j < count; ++j) sum += std::exp(score[j] - new_max);
        running_max[t] = new_max;
        running_sum[t] = sum;
      }
    }
    for (std::int64_t t = 0; t < task.tokens; ++t)
      if (visible[t] > 0) p.lse[row0 + t] = running_max[t] + std::log(running_sum[t]);
  });
}

}  // namespace dsa::cpu
