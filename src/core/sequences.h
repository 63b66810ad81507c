// Resolves the length arguments of an op into per-sequence slices of the
// flattened tensors (TND and BSND alike), validating them on the way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "dsa/layout.h"

namespace dsa::core {

struct SequenceSlice {
  std::int64_t q_begin = 0, q_len = 0;  // rows of the flattened query tensor
  std::int64_t k_begin = 0, k_len = 0;  // raw keys: first row in the raw key tensor, raw length
  std::int64_t c_begin = 0, c_len = 0;  // compressed entries: first row, count (= k_len // ratio)

  // Raw key position of query i (bottom-right alignment).
  std::int64_t position(std::int64_t i) const { return k_len - q_len + i; }
};

struct LengthSpec {
  Layout layout = Layout::TND;
  std::int64_t batch = 1;        // BSND: B (TND: ignored)
  std::int64_t q_extent = 0;     // TND: T; BSND: Sq
  std::int64_t k_extent = -1;    // raw key rows (TND: S, BSND: Sk); -1: the op has no raw keys
  std::int64_t c_extent = -1;    // compressed rows (TND: S', BSND: Sk'); -1: none
  std::int64_t ratio = 1;
  const CuSeqlens* cu_q = nullptr;
  const CuSeqlens* cu_k = nullptr;
};

struct SequencePlan {
  std::vector<SequenceSlice> seqs;
  std::int64_t q_rows = 0;  // rows of the flattened query tensor (T or B * Sq)
};

// Throws dsa::Error (invalid_argument) naming query_lengths / key_lengths when
// the lengths are not cu_seqlens-shaped, not monotone, inconsistent with the
// tensors, or give a sequence more queries than keys.
SequencePlan plan_sequences(const LengthSpec& spec);

// Marks rows of the flattened query tensor that belong to no sequence
// (BSND padding), so kernels can write the empty-row values there.
std::vector<std::int64_t> padding_rows(const SequencePlan& plan);

// Which keys an index list addresses: raw positions (< k_len) or compressed
// entries (< c_len, DeepSeek-V4's cmp_indices).
enum class IndexSpace { raw, compressed };

// Throws dsa::Error (invalid_argument) naming `name` when an index of a
// sequence's row lies outside [-1, its key count): a position the sequence
// does not hold is a caller's mistake (a global slot passed for a position,
// say), which the kernels would otherwise skip without a word. Rows of no
// sequence (BSND padding) are not read. Row r's list is idx + r * row_stride.
void require_indices_in_sequences(const SequencePlan& plan, const std::int32_t* idx,
                                  std::int64_t row_stride, std::int64_t topk, IndexSpace space,
                                  const char* name);

// One task of the fused kernels' dynamic schedule: `tokens` query rows of a
// sequence from row `first` (of the sequence), and what it costs.
struct QueryBlock {
  std::int64_t seq, first, tokens, cost;
};

// Internal linkage: instantiated in files built for different ISAs.
namespace {

// Every sequence's query rows (those of packed rows [lo, hi) only) in blocks of
// `block` rows, costliest first; cost(seq, first, tokens) of each. Under causal
// attention late rows see more keys, and starting the dear blocks first keeps
// the threads even. The order never changes a result: each task owns its rows.
template <class Cost>
std::vector<QueryBlock> query_blocks(const SequencePlan& plan, std::int64_t block, const Cost& cost,
                                     std::int64_t lo = 0,
                                     std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
  std::vector<QueryBlock> tasks;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(plan.seqs.size()); ++b) {
    const SequenceSlice& seq = plan.seqs[b];
    const std::int64_t end = std::min(seq.q_len, hi - seq.q_begin);
    for (std::int64_t first = std::max<std::int64_t>(0, lo - seq.q_begin); first < end; first += block) {
      const std::int64_t tokens = std::min(block, end - first);
      tasks.push_back({b, first, tokens, cost(seq, first, tokens)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const QueryBlock& a, const QueryBlock& b) { return a.cost > b.cost; });
  return tasks;
}

}  // namespace

}  // namespace dsa::core
