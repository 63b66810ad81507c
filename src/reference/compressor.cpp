// Reference KV compressor: docs/ops.md 4.5 written out literally, in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/numeric.h"
#include "ops/compressor.h"

namespace dsa::reference {
namespace {

using core::load_float;
using core::store_float;

// One pooling slot of entry w: a token row, the channel offset of its half of
// kv / gate, and the bias row it adds.
struct Slot {
  std::int64_t row;
  std::int64_t channel_offset;
  std::int64_t bias_row;
};

// The slots of entry w of a sequence: with overlap, block w-1 on channels [0, c)
// then block w on [c, 2c); without, block w on [0, c).
std::vector<Slot> entry_slots(const CompressorProblem& p, const CompressorSequence& s,
                              std::int64_t w) {
  std::vector<Slot> slots;
  const std::int64_t m = p.ratio;
  if (p.overlap && w > 0)
    for (std::int64_t j = 0; j < m; ++j) slots.push_back({s.token_begin + (w - 1) * m + j, 0, j});
  for (std::int64_t j = 0; j < m; ++j)
    slots.push_back({s.token_begin + w * m + j, p.overlap ? p.channels : 0, j});
  return slots;
}

double logit(const CompressorProblem& p, const Slot& slot, std::int64_t channel) {
  const std::int64_t col = slot.channel_offset + channel;
  return static_cast<double>(load_float(p.gate, p.dtype, slot.row * p.gate_row_stride + col)) +
         static_cast<double>(p.position_bias[slot.bias_row * p.bias_row_stride + col]);
}

double kv_at(const CompressorProblem& p, const Slot& slot, std::int64_t channel) {
  return load_float(p.kv, p.dtype, slot.row * p.kv_row_stride + slot.channel_offset + channel);
}

// softmax over the slots of one channel; all -inf logits -> all weights 0.
// Also gives the logits' maximum and the sum of exp(logit - max) (0 and 0
// when no logit is finite), the statistics a forward may save.
std::vector<double> slot_weights(const CompressorProblem& p, const std::vector<Slot>& slots,
                                 std::int64_t channel, double* max_out = nullptr, double* sum_out = nullptr) {
  std::vector<double> weights(slots.size());
  double max = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    weights[i] = logit(p, slots[i], channel);
    if (weights[i] > max) max = weights[i];
  }
  double sum = 0.0;
  if (max == -std::numeric_limits<double>::infinity()) {
    max = 0.0;
    for (double& x : weights) x = 0.0;
  } else {
    for (double& x : weights) {
      x = std::exp(x - max);
      sum += x;
    }
    for (double& x : weights) x /= sum;
  }
  if (max_out) *max_out = max;
  if (sum_out) *sum_out = sum;
  return weights;
}

}  // namespace

void compressor_fwd(const CompressorProblem& p) {
  const std::int64_t c = p.channels;
  for (std::int64_t r = 0; r < p.out_rows * c; ++r) store_float(p.compressed, p.dtype, r, 0.0f);
  if (p.stats) std::fill(p.stats, p.stats + p.out_rows * 3 * c, 0.0f);
  for (const CompressorSequence& s : p.seqs) {
    for (std::int64_t w = 0; w < s.entries; ++w) {
      const std::vector<Slot> slots = entry_slots(p, s, w);
      for (std::int64_t ch = 0; ch < c; ++ch) {
        double max = 0.0, sum = 0.0;
        const std::vector<double> weights = slot_weights(p, slots, ch, &max, &sum);
        double out = 0.0;
        for (std::size_t i = 0; i < slots.size(); ++i) out += weights[i] * kv_at(p, slots[i], ch);
        store_float(p.compressed, p.dtype, (s.out_begin + w) * c + ch, static_cast<float>(out));
        if (p.stats) {
          float* row = p.stats + (s.out_begin + w) * 3 * c;
          row[ch] = static_cast<float>(max);
          row[c + ch] = sum > 0.0 ? static_cast<float>(1.0 / sum) : 0.0f;
          row[2 * c + ch] = static_cast<float>(out);
        }
      }
    }
  }
}

// The statistics a forward saved (p.stats) are not read: the oracle recomputes.
void compressor_bwd(const CompressorProblem& p) {
  const std::int64_t c = p.channels, C = p.in_channels, m = p.ratio;
  for (std::int64_t i = 0; i < p.rows * C; ++i) {
    store_float(p.grad_kv, p.dtype, i, 0.0f);
    store_float(p.grad_gate, p.dtype, i, 0.0f);
  }
  std::vector<double> grad_bias(m * C, 0.0);
  for (const CompressorSequence& s : p.seqs) {
    for (std::int64_t w = 0; w < s.entries; ++w) {
      const std::vector<Slot> slots = entry_slots(p, s, w);
      for (std::int64_t ch = 0; ch < c; ++ch) {
        const std::vector<double> weights = slot_weights(p, slots, ch);
        const double g = load_float(p.grad_compressed, p.dtype,
                                    (s.out_begin + w) * p.grad_compressed_row_stride + ch);
        double out = 0.0;
        for (std::size_t i = 0; i < slots.size(); ++i) out += weights[i] * kv_at(p, slots[i], ch);
        // d out / d kv_i = p_i;  d out / d logit_i = p_i * (kv_i - out).
        for (std::size_t i = 0; i < slots.size(); ++i) {
          const Slot& slot = slots[i];
          const std::int64_t at = slot.row * C + slot.channel_offset + ch;
          const double grad_logit = weights[i] * g * (kv_at(p, slot, ch) - out);
          store_float(p.grad_kv, p.dtype, at, static_cast<float>(weights[i] * g));
          store_float(p.grad_gate, p.dtype, at, static_cast<float>(grad_logit));
          grad_bias[slot.bias_row * C + slot.channel_offset + ch] += grad_logit;
        }
      }
    }
  }
  for (std::int64_t i = 0; i < m * C; ++i) p.grad_position_bias[i] = static_cast<float>(grad_bias[i]);
}

}  // namespace dsa::reference
