// DeepSeek-V4's compressor for decode (docs/serving.md): the entries that new
// tokens complete, from a per-request state that holds the tokens a later
// entry still needs, so a step never re-reads the context.
//
// The pooling is dsa/compressor.h's: entry w of a request pools block w (its m
// tokens; with overlap on channels [c, 2c)) and, with overlap and w > 0, block
// w-1 on channels [0, c), under an fp32 softmax over the slots per channel.
//
// State of request b: a ring of R = (overlap ? 2 : 1) * m rows of kv and of
// gate, fp32, C channels each; absolute token t lives in row t % R. Before a
// call with lengths[b] = L0 tokens already appended it must hold tokens
//   [keep_from(L0), L0),  keep_from(L) = max(0, (L / m) * m - (overlap ? m : 0)),
// (the incomplete block, and with overlap the block before it): what this op
// leaves there for L0 + new_lens[b]. A fresh request starts at L0 = 0 with any
// state. The call appends new_lens[b] rows of kv / gate and writes the entries
// w in [L0 / m, (L0 + new_lens[b]) / m) to compressed[b, 0 ..], the rest of
// compressed[b] 0. The caller advances lengths[b] itself.
//
// Appending a prompt at once, or in chunks, or one token at a time gives the
// entries of compressor_fwd on the whole sequence; for fp32 inputs bit for bit
// (the same pooling kernels, slots in the same order). bf16 / fp16 entries whose
// slots are all new rows are compressor_fwd's bits too; those that pool state
// rows pool them in fp32 and round once.
#pragma once

#include <cstdint>
#include <optional>

#include "dsa/backend.h"
#include "dsa/tensor.h"

namespace dsa {

struct CompressorAppendParams {
  std::int64_t ratio = 0;       // m >= 1 tokens per block
  std::optional<bool> overlap;  // empty: overlap iff ratio == 4 (CSA), as compressor_fwd
  int num_threads = 0;          // 0: default_num_threads()
};

// Ring rows of a state: (overlap ? 2 : 1) * ratio.
std::int64_t compressor_state_rows(std::int64_t ratio, bool overlap);

// Shapes (C = (overlap ? 2 : 1) * c):
//   kv, gate      [B, n, C]  bf16, fp16 or fp32 (same dtype), unit stride in C
//   position_bias [m, C]     fp32
//   state_kv, state_gate [B, R, C] fp32, contiguous; read, then updated in place
//   lengths       [B] int32 / int64: tokens appended before this call
//   new_lens      [B] int32 / int64, each <= n (rows of kv to append), or a
//                 default TensorView{} (absent): n for every request
//   compressed    [B, ceil(n / m), c], dtype of kv, contiguous, written
void compressor_append(const TensorView& kv, const TensorView& gate, const TensorView& position_bias,
                       const TensorView& state_kv, const TensorView& state_gate, const TensorView& lengths,
                       const TensorView& new_lens, const CompressorAppendParams& params,
                       const TensorView& compressed, Backend backend = Backend::automatic);

}  // namespace dsa
