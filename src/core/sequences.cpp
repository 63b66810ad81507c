#include "core/sequences.h"

#include "core/validate.h"

namespace dsa::core {
namespace {

void check_cu(const CuSeqlens& cu, const char* name) {
  if (cu.empty() || cu[0] != 0)
    fail_argument(name, ": internal cu_seqlens must start with 0 (B+1 entries)");
  for (std::size_t b = 1; b < cu.size(); ++b)
    if (cu[b] < cu[b - 1])
      // The ends, not their difference: that overflows int64 for an end such as
      // INT64_MIN after a positive one (found by fuzz_indexer).
      fail_argument(name, ": lengths must be non-negative and cumulative ends non-decreasing; ",
                    "sequence ", b - 1, " ends at ", cu[b], " before its start ", cu[b - 1]);
}

CuSeqlens full(std::int64_t batch, std::int64_t extent) {
  CuSeqlens cu(batch + 1);
  for (std::int64_t b = 0; b <= batch; ++b) cu[b] = b * extent;
  return cu;
}

}  // namespace

SequencePlan plan_sequences(const LengthSpec& spec) {
  const bool tnd = spec.layout == Layout::TND;
  const bool has_raw = spec.k_extent >= 0;
  const bool has_cmp = spec.c_extent >= 0 && spec.ratio > 1;
  if (spec.ratio < 1) fail_argument("cmp_ratio: expected a ratio >= 1, got ", spec.ratio);

  CuSeqlens cu_q = (spec.cu_q && !spec.cu_q->empty())
                       ? *spec.cu_q
                       : (tnd ? CuSeqlens{0, spec.q_extent} : full(spec.batch, spec.q_extent));
  check_cu(cu_q, "query_lengths");
  const std::int64_t batch = static_cast<std::int64_t>(cu_q.size()) - 1;
  if (!tnd && batch != spec.batch)
    fail_argument("query_lengths: expected ", spec.batch, " entries (one per batch row), got ",
                  batch);

  CuSeqlens cu_k;
  const bool keys_given = spec.cu_k && !spec.cu_k->empty();
  if (keys_given) {
    cu_k = *spec.cu_k;
  } else if (has_raw) {
    cu_k = tnd ? CuSeqlens{0, spec.k_extent} : full(spec.batch, spec.k_extent);
  } else {
    cu_k = cu_q;  // compressed keys only: the raw keys are the queries' own tokens
  }
  check_cu(cu_k, "key_lengths");
  if (static_cast<std::int64_t>(cu_k.size()) - 1 != batch) {
    // Without key_lengths the raw keys are one sequence: say so rather than count it.
    if (!keys_given)
      fail_argument("key_lengths: not given, so the keys are one sequence, but query_lengths holds ", batch,
                    "; pass key_lengths too (the keys' cumulative ends, one per query sequence)");
    fail_argument("key_lengths: expected ", batch, " sequences like query_lengths, got ", cu_k.size() - 1);
  }

  SequencePlan plan;
  plan.q_rows = tnd ? spec.q_extent : spec.batch * spec.q_extent;
  plan.seqs.resize(batch);
  std::int64_t c_offset = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    SequenceSlice& s = plan.seqs[b];
    s.q_len = cu_q[b + 1] - cu_q[b];
    s.k_len = cu_k[b + 1] - cu_k[b];
    s.c_len = compressed_length(s.k_len, spec.ratio);
    if (tnd) {
      s.q_begin = cu_q[b];
      s.k_begin = cu_k[b];
      s.c_begin = c_offset;
    } else {
      if (s.q_len > spec.q_extent)
        fail_argument("query_lengths: row ", b, " has length ", s.q_len,
                      " but the query tensor holds ", spec.q_extent, " per row");
      if (has_raw && s.k_len > spec.k_extent)
        fail_argument("key_lengths: row ", b, " has length ", s.k_len,
                      " but the key tensor holds ", spec.k_extent, " per row");
      if (has_cmp && s.c_len > spec.c_extent)
        fail_argument("key_lengths: row ", b, " has ", s.k_len, " raw keys, i.e. ", s.c_len,
                      " compressed entries at ratio ", spec.ratio,
                      ", but the compressed key tensor holds ", spec.c_extent, " per row");
      s.q_begin = b * spec.q_extent;
      s.k_begin = b * (has_raw ? spec.k_extent : 0);
      s.c_begin = b * (has_cmp ? spec.c_extent : 0);
    }
    c_offset += s.c_len;
    if (s.q_len > s.k_len)
      fail_argument("query_lengths/key_lengths: sequence ", b, " has ", s.q_len,
                    " queries but only ", s.k_len,
                    " keys; queries are aligned bottom-right, so Lq must be <= Lk");
  }
  if (tnd) {
    if (cu_q.back() != spec.q_extent)
      fail_argument("query_lengths: the last cumulative end must equal the number of query tokens ",
                    spec.q_extent, ", got ", cu_q.back());
    if (has_raw && cu_k.back() != spec.k_extent)
      fail_argument("key_lengths: the last cumulative end must equal the number of keys ",
                    spec.k_extent, ", got ", cu_k.back());
    if (has_cmp && c_offset != spec.c_extent)
      fail_argument("key_lengths: raw lengths give ", c_offset, " compressed entries at ratio ",
                    spec.ratio, ", but the compressed key tensor has ", spec.c_extent, " rows");
  }
  if (!has_cmp)
    for (auto& s : plan.seqs) {
      s.c_begin = s.k_begin;
    }
  return plan;
}

std::vector<std::int64_t> padding_rows(const SequencePlan& plan) {
  std::vector<char> used(plan.q_rows, 0);
  for (const auto& s : plan.seqs)
    for (std::int64_t i = 0; i < s.q_len; ++i) used[s.q_begin + i] = 1;
  std::vector<std::int64_t> rows;
  for (std::int64_t r = 0; r < plan.q_rows; ++r)
    if (!used[r]) rows.push_back(r);
  return rows;
}

void require_indices_in_sequences(const SequencePlan& plan, const std::int32_t* idx,
                                  std::int64_t row_stride, std::int64_t topk, IndexSpace space,
                                  const char* name) {
  for (std::size_t n = 0; n < plan.seqs.size(); ++n) {
    const SequenceSlice& s = plan.seqs[n];
    const std::int64_t held = space == IndexSpace::raw ? s.k_len : s.c_len;
    for (std::int64_t i = 0; i < s.q_len; ++i) {
      const std::int32_t* row = idx + (s.q_begin + i) * row_stride;
      // One compare per entry on the common path: unsigned (v + 1) <= held
      // holds exactly for -1 <= v < held.
      bool ok = true;
      for (std::int64_t k = 0; k < topk; ++k)
        ok &= static_cast<std::uint64_t>(static_cast<std::int64_t>(row[k]) + 1) <=
              static_cast<std::uint64_t>(held);
      if (ok) continue;
      for (std::int64_t k = 0; k < topk; ++k)
        if (row[k] < -1 || row[k] >= held)
          fail_argument(name, ": row ", s.q_begin + i, " (query ", i, " of sequence ", n, ") entry ", k,
                        " is ", row[k], ", outside the sequence's ", held,
                        space == IndexSpace::raw ? " keys" : " compressed entries",
                        "; expected a position in [0, ", held, ") or -1 (positions are inside the "
                        "query's own sequence, not global rows)");
    }
  }
}

}  // namespace dsa::core
