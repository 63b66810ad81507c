// Running top-k of one query row for the fused indexer.
//
// Candidates are appended in ascending key position as (order key, position);
// when the buffer fills it is cut back to the k best by a radix select on the
// 32-bit order keys, keeping position order, and the k-th best key becomes the
// bar a new candidate must clear. Equal scores keep the earlier position, which
// is the spec's tie rule, so the result never depends on how tiles were cut.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace dsa::cpu::indexer_kernels {

// Monotone map of a score to uint32: larger score -> larger key; NaN -> 0,
// below every number; -0 and +0 map to the same key.
inline std::uint32_t score_key(float score) {
  if (score != score) return 0;
  score += 0.0f;
  std::int32_t bits;
  std::memcpy(&bits, &score, 4);
  const std::int32_t ordered = bits < 0 ? bits ^ 0x7fffffff : bits;
  return static_cast<std::uint32_t>(ordered) ^ 0x80000000u;
}

// Inverse of score_key (key 0 gives a NaN; -0 comes back as +0).
inline float key_score(std::uint32_t key) {
  const std::int32_t ordered = static_cast<std::int32_t>(key ^ 0x80000000u);
  const std::int32_t bits = ordered < 0 ? ordered ^ 0x7fffffff : ordered;
  float score;
  std::memcpy(&score, &bits, 4);
  return score;
}

// Appends the scores of one tile that beat the bar (all of them when
// accept_all) and returns how many were appended. One implementation per ISA.
using AppendCandidatesFn = std::int64_t (*)(const float* scores, std::int64_t n,
                                            std::int32_t first_position, std::uint32_t bar,
                                            bool accept_all, std::uint32_t* keys,
                                            std::int32_t* positions);

inline std::int64_t append_candidates_portable(const float* scores, std::int64_t n,
                                               std::int32_t first_position, std::uint32_t bar,
                                               bool accept_all, std::uint32_t* keys,
                                               std::int32_t* positions) {
  std::int64_t count = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    const std::uint32_t key = score_key(scores[s]);
    if (accept_all || key > bar) {
      keys[count] = key;
      positions[count++] = first_position + static_cast<std::int32_t>(s);
    }
  }
  return count;
}

std::int64_t append_candidates_avx512(const float* scores, std::int64_t n,
                                      std::int32_t first_position, std::uint32_t bar,
                                      bool accept_all, std::uint32_t* keys,
                                      std::int32_t* positions);

// The candidate filters as kernel tables, for cpu/select.h.
struct CandidateFilter {
  const char* name;
  AppendCandidatesFn append;
};
inline const CandidateFilter& portable_filter() {
  static const CandidateFilter filter{"portable", append_candidates_portable};
  return filter;
}
inline const CandidateFilter& avx512_filter() {
  static const CandidateFilter filter{"avx512", append_candidates_avx512};
  return filter;
}

struct RowTopK {
  std::uint32_t* keys = nullptr;
  std::int32_t* positions = nullptr;
  std::int64_t count = 0;
  bool has_bar = false;
  std::uint32_t bar = 0;  // a new candidate's key must exceed it

  void push(AppendCandidatesFn append, const float* scores, std::int64_t first_position,
            std::int64_t n) {
    count += append(scores, n, static_cast<std::int32_t>(first_position), bar, !has_bar,
                    keys + count, positions + count);
  }

  // Keeps exactly the k best candidates (ties: smaller position), in position order.
  // `boundary` is scratch for up to `count` keys.
  void cut_to(std::int64_t k, std::uint32_t* boundary) {
    if (count <= k) return;
    // Radix select of the k-th largest key: a 12-bit histogram of the top bits
    // over all candidates, then the lower 20 bits only among the candidates
    // of the bin that holds the k-th (usually a small fraction).
    std::int64_t need = k;  // candidates still wanted among those matching the prefix
    std::uint32_t histogram[4096] = {};
    for (std::int64_t i = 0; i < count; ++i) ++histogram[keys[i] >> 20];
    std::uint32_t top = 4095;
    for (; top > 0 && histogram[top] < need; --top) need -= histogram[top];
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < count; ++i)
      if ((keys[i] >> 20) == top) boundary[n++] = keys[i];
    std::uint32_t prefix = top << 20;
    for (int shift : {10, 0}) {
      std::uint32_t bins[1024] = {};
      const std::uint32_t mask = ~((1u << (shift + 10)) - 1);
      for (std::int64_t i = 0; i < n; ++i)
        if ((boundary[i] & mask) == prefix) ++bins[(boundary[i] >> shift) & 1023];
      std::uint32_t bin = 1023;
      for (; bin > 0 && bins[bin] < need; --bin) need -= bins[bin];
      prefix |= bin << shift;
    }
    // `prefix` is the k-th largest key; keep everything above it and the first
    // `need` candidates equal to it (the smallest positions).
    std::int64_t kept = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      const std::uint32_t key = keys[i];
      if (key > prefix || (key == prefix && need-- > 0)) {
        keys[kept] = key;
        positions[kept++] = positions[i];
      }
    }
    count = kept;
    has_bar = true;
    bar = prefix;
  }
};

}  // namespace dsa::cpu::indexer_kernels
