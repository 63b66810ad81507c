// The indexer's selection rule, shared by the reference indexers (prefill and
// decode): the `topk` best candidates, larger score first, NaN below every
// number, equal scores to the smaller position; written as positions
// ascending, then -1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace dsa::reference {

struct Candidate {
  float score;
  std::int64_t position;
};

inline bool ranks_before(const Candidate& a, const Candidate& b) {
  const bool a_nan = std::isnan(a.score), b_nan = std::isnan(b.score);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a.score != b.score) return a.score > b.score;
  return a.position < b.position;
}

// Sorts `candidates` so that the first min(topk, size) are the selection in
// position order; returns that count.
inline std::int64_t select_topk(std::vector<Candidate>& candidates, std::int64_t topk) {
  const std::int64_t keep = std::min<std::int64_t>(topk, static_cast<std::int64_t>(candidates.size()));
  std::stable_sort(candidates.begin(), candidates.end(), ranks_before);
  std::sort(candidates.begin(), candidates.begin() + keep,
            [](const Candidate& a, const Candidate& b) { return a.position < b.position; });
  return keep;
}

}  // namespace dsa::reference
