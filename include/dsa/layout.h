// Layouts and lengths (docs/ops.md section 1).
//
// In C++ every length array is cu_seqlens: B+1 non-decreasing entries starting
// at 0. For TND they index the packed token dimension; for BSND entry b+1 - b is
// the valid length of batch row b (rows are padded to the tensor's Sq / Sk).
// Key lengths always speak of raw keys, also when an op reads compressed keys.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace dsa {

enum class Layout : int { TND, BSND };

Layout parse_layout(std::string_view name);  // "TND" | "BSND"
const char* layout_name(Layout layout);

// Lengths given by a caller: empty means "one full sequence" (TND) or
// "every row full" (BSND).
using CuSeqlens = std::vector<std::int64_t>;

// Number of compressed entries of a sequence of `raw_length` keys.
inline std::int64_t compressed_length(std::int64_t raw_length, std::int64_t ratio) {
  return ratio > 1 ? raw_length / ratio : raw_length;
}

// Bottom-right alignment: the key position of query i among Lq queries over Lk keys.
inline std::int64_t query_position(std::int64_t i, std::int64_t query_length,
                                   std::int64_t key_length) {
  return key_length - query_length + i;
}

// Compressed entries visible to a query at raw position `pos`: w < (pos + 1) / m.
inline std::int64_t visible_compressed(std::int64_t pos, std::int64_t ratio) {
  return ratio > 1 ? (pos + 1) / ratio : pos + 1;
}

}  // namespace dsa
