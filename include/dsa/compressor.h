// DeepSeek-V4 KV compressor: gated, per-channel softmax pooling (docs/ops.md 4.5).
//
// A sequence of L raw tokens yields L // m compressed entries (tail tokens are
// dropped). Per channel, entry w is
//
//   compressed[w] = sum_slots softmax_slots(gate + bias) * kv      (fp32 softmax)
//
// Non-overlapping (HCA, e.g. m = 128): the m slots are the tokens of block w on
//   channels [0, c), bias rows position_bias[j, 0:c].
// Overlapping (CSA, m = 4): 2m slots, the tokens of block w-1 on channels [0, c)
//   (bias position_bias[j, 0:c]) and those of block w on channels [c, 2c)
//   (bias position_bias[j, c:2c]); entry 0 has no previous block.
// A channel whose logits are all -inf gets 0 (and zero gradients).
// RMSNorm and RoPE of the compressed entries stay outside the op.
#pragma once

#include <cstdint>
#include <optional>

#include "dsa/backend.h"
#include "dsa/layout.h"
#include "dsa/tensor.h"

namespace dsa {

struct CompressorParams {
  std::int64_t ratio = 0;               // m >= 1 tokens per block
  std::optional<bool> overlap;          // empty: overlap iff ratio == 4 (CSA)
  Layout layout = Layout::TND;
  CuSeqlens cu_seqlens;                 // raw token lengths; empty: one full sequence
                                        // (TND) / every row full (BSND)
  int num_threads = 0;                  // 0: default_num_threads()
};

// Raw cu_seqlens (leading 0) -> the compressed tensor's cu_seqlens: each
// sequence of L tokens yields L // ratio entries. Size TND outputs with back().
CuSeqlens compressed_cu_seqlens(const CuSeqlens& raw_cu_seqlens, std::int64_t ratio);

// coff = 2 with overlap, else 1; C = coff * c.
// Shapes (TND | BSND):
//   kv, gate       [S, C]     | [B, Sk, C]        bf16, fp16 or fp32 (same dtype)
//   position_bias  [m, C]                          fp32
//   compressed     [S_cmp, c] | [B, Sk // m, c]   dtype of kv, contiguous, written;
//                  S_cmp = sum over sequences of L // m. BSND rows past a row's
//                  count are written 0.
void compressor_fwd(const TensorView& kv, const TensorView& gate, const TensorView& position_bias,
                    const CompressorParams& params, const TensorView& compressed,
                    Backend backend = Backend::automatic);

// Softmax statistics a forward can save for the backward, per compressed entry
// and output channel, as `stats` [S_cmp, 3, c] | [B, Sk // m, 3, c] fp32,
// contiguous: the logits' maximum (0 where no logit is finite), 1 / sum of
// exp(logit - max) (0 there), and the pooled value in fp32. A backward given
// them computes each slot's weight straight from its logit, in one pass over
// the slots instead of three: worth it when an entry pools many slots, not
// for a few: compressor_stats_pay_off, true from compressor_stats_min_slots()
// slots per entry ((overlap ? 2 : 1) * ratio). The reference backend writes
// them too, but its backward recomputes everything.
std::int64_t compressor_stats_min_slots();
bool compressor_stats_pay_off(std::int64_t ratio, bool overlap);
void compressor_fwd(const TensorView& kv, const TensorView& gate, const TensorView& position_bias,
                    const CompressorParams& params, const TensorView& compressed, const TensorView& stats,
                    Backend backend = Backend::automatic);

// grad_compressed: like `compressed` (unit stride in the last dim).
// grad_kv, grad_gate: like kv (dtype of kv, contiguous), written everywhere: tokens
// of dropped tail blocks, BSND padding and the unused [0, c) half of the last
// block of a sequence get 0. grad_position_bias: [m, C] fp32, contiguous, written.
void compressor_bwd(const TensorView& grad_compressed, const TensorView& kv,
                    const TensorView& gate, const TensorView& position_bias,
                    const CompressorParams& params, const TensorView& grad_kv,
                    const TensorView& grad_gate, const TensorView& grad_position_bias,
                    Backend backend = Backend::automatic);
// The same, from the statistics the forward saved.
void compressor_bwd(const TensorView& grad_compressed, const TensorView& kv,
                    const TensorView& gate, const TensorView& position_bias, const TensorView& stats,
                    const CompressorParams& params, const TensorView& grad_kv,
                    const TensorView& grad_gate, const TensorView& grad_position_bias,
                    Backend backend = Backend::automatic);

}  // namespace dsa
