// Reference sparse decode attention: the definition in
// include/dsa/sparse_attention_decode.h, one row and head at a time, each key
// dequantised from its record, logits and sums in double. The oracle of the
// fused backend.
#include <cmath>
#include <vector>

#include "core/numeric.h"
#include "ops/sparse_attention_decode.h"

namespace dsa::reference {

void sparse_attention_decode(const SparseAttentionDecodeProblem& p) {
  const std::int64_t H = p.heads, D = p.dim, dv = p.d_v;
  std::vector<float> keys, key(D);
  std::vector<double> logits, acc(dv);
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t j = 0; j < p.next_n; ++j) {
      keys.clear();
      p.for_each_attended(b, j, [&](bool compressed, std::int64_t pos) {
        core::decode_token(compressed ? p.cmp : p.kv, p.record(b, compressed, pos), key.data());
        keys.insert(keys.end(), key.begin(), key.end());
      });
      const std::int64_t n = static_cast<std::int64_t>(keys.size()) / D, row = b * p.next_n + j;
      logits.assign(n, 0.0);
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t q0 = b * p.q_batch_stride + j * p.q_row_stride + h * p.q_head_stride;
        double m = -INFINITY;
        for (std::int64_t k = 0; k < n; ++k) {
          double dot = 0.0;
          for (std::int64_t d = 0; d < D; ++d) dot += static_cast<double>(core::load_float(p.query, p.dtype, q0 + d)) * keys[k * D + d];
          logits[k] = static_cast<double>(p.scale) * dot;
          if (logits[k] > m) m = logits[k];  // NaN left out, as the prefill op does
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = 0.0;
        if (n > 0 && m == -INFINITY) sum = NAN;  // keys, but no logit above -inf: NaN, as dsa_sparse_attention
        for (std::int64_t k = 0; k < n && m != -INFINITY; ++k) {
          const double w = std::exp(logits[k] - m);
          sum += w;
          for (std::int64_t d = 0; d < dv; ++d) acc[d] += w * keys[k * D + d];
        }
        double denom = sum;
        if (p.sinks && m != -INFINITY) denom += std::exp(static_cast<double>(p.sinks[h]) - m);
        const std::int64_t o0 = (row * H + h) * dv;
        for (std::int64_t d = 0; d < dv; ++d)
          core::store_float(p.out, p.dtype, o0 + d, n == 0 ? 0.0f : static_cast<float>(acc[d] / denom));
        p.lse[row * H + h] = n == 0 ? -INFINITY : static_cast<float>(m + std::log(sum));
      }
    }
}

}  // namespace dsa::reference
