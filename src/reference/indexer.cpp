// Reference lightning indexer: docs/ops.md 4.1, literally, one query at a time.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/numeric.h"
#include "ops/indexer.h"
#include "reference/ranking.h"

namespace dsa::reference {

void indexer_topk(const IndexerProblem& p) {
  using core::load_float;
  std::fill(p.indices, p.indices + p.plan.q_rows * p.topk, -1);
  if (p.scores) std::fill(p.scores, p.scores + p.plan.q_rows * p.topk, core::kNegInf);

  std::vector<Candidate> candidates;
  for (const auto& seq : p.plan.seqs) {
    for (std::int64_t i = 0; i < seq.q_len; ++i) {
      const std::int64_t row = seq.q_begin + i;
      const std::int64_t visible = visible_compressed(seq.position(i), p.ratio);
      candidates.clear();
      for (std::int64_t s = 0; s < visible; ++s) {
        const std::int64_t key_row = seq.c_begin + s;
        double score = 0.0;
        for (std::int64_t h = 0; h < p.heads; ++h) {
          double dot = 0.0;
          for (std::int64_t d = 0; d < p.dim; ++d)
            dot += static_cast<double>(load_float(p.query, p.dtype, row * p.query_row_stride + h * p.query_head_stride + d)) *
                   load_float(p.key, p.dtype, key_row * p.key_row_stride + d);
          const double w = load_float(p.weights, p.weights_dtype,
                                      row * p.weights_row_stride + h * p.weights_head_stride);
          // The ReLU keeps NaN, as torch.relu and the fused kernels do: a NaN score
          // must stay NaN so that it ranks below every number (spec section 2).
          score += w * core::relu(dot);
        }
        candidates.push_back({static_cast<float>(p.scale * score), s});
      }
      const std::int64_t keep = select_topk(candidates, p.topk);
      for (std::int64_t k = 0; k < keep; ++k) {
        p.indices[row * p.topk + k] = static_cast<std::int32_t>(candidates[k].position);
        if (p.scores) p.scores[row * p.topk + k] = candidates[k].score;
      }
    }
  }
}

}  // namespace dsa::reference
