// Reference paged decode indexer: the definition in include/dsa/indexer_decode.h,
// one row at a time, each key dequantised from its record, scores in double,
// the prefill reference's selection rule (reference/ranking.h).
#include <algorithm>
#include <vector>

#include "core/numeric.h"
#include "ops/indexer_decode.h"
#include "reference/ranking.h"

namespace dsa::reference {

void indexer_decode(const IndexerDecodeProblem& p) {
  std::vector<float> key(p.dim);
  std::vector<Candidate> candidates;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t j = 0; j < p.next_n; ++j) {
      candidates.clear();
      const std::int64_t q0 = b * p.q_batch_stride + j * p.q_row_stride;
      for (std::int64_t s = 0; s < p.visible(b, j); ++s) {
        core::decode_token(p.keys, p.keys.token(p.table.slot(b, s)), key.data());
        double score = 0.0;
        for (std::int64_t h = 0; h < p.heads; ++h) {
          double dot = 0.0;
          for (std::int64_t d = 0; d < p.dim; ++d)
            dot += static_cast<double>(core::load_float(p.query, p.dtype, q0 + h * p.q_head_stride + d)) * key[d];
          score += static_cast<double>(p.weight(b, j, h)) * core::relu(dot);  // relu keeps NaN
        }
        candidates.push_back({static_cast<float>(p.scale * score), s});
      }
      const std::int64_t keep = select_topk(candidates, p.topk);
      std::int32_t* out = p.indices + (b * p.next_n + j) * p.topk;
      std::fill(out, out + p.topk, -1);
      for (std::int64_t k = 0; k < keep; ++k) out[k] = static_cast<std::int32_t>(candidates[k].position);
    }
}

}  // namespace dsa::reference
