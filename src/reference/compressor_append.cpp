// Reference decode compressor: dsa/compressor_append.h written out literally,
// in double, one request and one entry at a time.
#include <cmath>
#include <limits>
#include <vector>

#include "core/numeric.h"
#include "ops/compressor_append.h"

namespace dsa::reference {

void compressor_append(const CompressorAppendProblem& p) {
  using core::load_float;
  const std::int64_t m = p.ratio, c = p.channels, C = p.in_channels;
  for (std::int64_t i = 0; i < p.batch * p.out_rows * c; ++i) core::store_float(p.compressed, p.dtype, i, 0.0f);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t start = p.lengths[b];
    // Token t's kv (or gate) value on channel `col`: a new row, or the state's.
    auto value = [&](bool is_gate, std::int64_t t, std::int64_t col) -> double {
      if (t >= start) {
        const std::int64_t i = t - start;
        return is_gate ? load_float(p.gate, p.dtype, b * p.gate_batch_stride + i * p.gate_row_stride + col)
                       : load_float(p.kv, p.dtype, b * p.kv_batch_stride + i * p.kv_row_stride + col);
      }
      return p.state_row(is_gate ? p.state_gate : p.state_kv, b, t)[col];
    };
    for (std::int64_t w = p.first_entry(b); w < p.end_entry(b); ++w) {
      struct Slot {
        std::int64_t token, offset, bias_row;
      };
      std::vector<Slot> slots;
      if (p.overlap && w > 0)
        for (std::int64_t j = 0; j < m; ++j) slots.push_back({(w - 1) * m + j, 0, j});
      for (std::int64_t j = 0; j < m; ++j) slots.push_back({w * m + j, p.overlap ? c : 0, j});
      for (std::int64_t ch = 0; ch < c; ++ch) {
        std::vector<double> logit(slots.size());
        double max = -std::numeric_limits<double>::infinity();
        for (std::size_t s = 0; s < slots.size(); ++s) {
          const std::int64_t col = slots[s].offset + ch;
          logit[s] = value(true, slots[s].token, col) + p.position_bias[slots[s].bias_row * p.bias_row_stride + col];
          if (logit[s] > max) max = logit[s];
        }
        double out = 0.0;
        if (max != -std::numeric_limits<double>::infinity()) {  // all -inf: 0
          double sum = 0.0;
          for (double& l : logit) sum += (l = std::exp(l - max));
          for (std::size_t s = 0; s < slots.size(); ++s)
            out += logit[s] / sum * value(false, slots[s].token, slots[s].offset + ch);
        }
        core::store_float(p.compressed, p.dtype, (b * p.out_rows + w - p.first_entry(b)) * c + ch,
                          static_cast<float>(out));
      }
    }
  }
  // The state, after every entry has read it: the new tokens a later entry needs.
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t start = p.lengths[b], end = start + p.new_lens[b];
    for (std::int64_t t = std::max(start, p.keep_from(end)); t < end; ++t) {
      float* kv_row = p.state_row(p.state_kv, b, t);
      float* gate_row = p.state_row(p.state_gate, b, t);
      const std::int64_t i = t - start;
      for (std::int64_t col = 0; col < C; ++col) {
        kv_row[col] = load_float(p.kv, p.dtype, b * p.kv_batch_stride + i * p.kv_row_stride + col);
        gate_row[col] = load_float(p.gate, p.dtype, b * p.gate_batch_stride + i * p.gate_row_stride + col);
      }
    }
  }
}

}  // namespace dsa::reference
