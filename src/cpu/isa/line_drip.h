// Asking for memory a few lines at a time from inside a product, so that the
// fetch of the next block of scattered rows overlaps the arithmetic on this one.
//
// A decode attention at H = 16 reads a 1152-byte cache record per key and does
// ~16 head products with it: the records' DRAM traffic takes longer than the
// products (Zen 4: 3.3 ms to read batch 16's 32768 records on two cores, 2.5 ms
// of products). Asked for in one burst, the prefetches fill the core's miss
// buffers and stall it until nearly all lines have arrived, so fetch and
// products take turns. Spread over the product at the pace it runs, a few
// prefetches at a time, the lines arrive while the products work.
//
// Use: the kernel lists the next block's rows, gives each product a share of
// their lines (budget), and each product engine calls pace(steps)
// once with the number of times it will call step(), then step() as it goes.
// A drip never changes a result; lines not asked for by the end are fetched
// by the next block's own copy.
#pragma once

#include <xmmintrin.h>

#include <cstdint>

namespace dsa::cpu {
namespace {  // internal linkage: included by files compiled for different ISAs

class LineDrip {
 public:
  // Rows r < n_rows, each `bytes` from rows[r] (a decode key is its whole cache record).
  void reset(const char* const* rows, std::int64_t bytes, std::int64_t n_rows) {
    rows_ = rows;
    bytes_ = bytes;
    n_rows_ = n_rows;
    row_ = -1;
    at_ = end_ = 0;
    budget_ = per_step_ = 0;
  }

  // The next product asks for `part / whole` of the rows' lines (at most all that
  // remain) over all its steps.
  void budget(std::int64_t part, std::int64_t whole) {
    const std::int64_t lines = n_rows_ * ((bytes_ + 63) / 64 + 1);  // + 1: a row may straddle one more line
    budget_ = whole > 0 ? lines * part / whole : lines;
  }

  // Called by a product before its first step: it will call step() `steps` times.
  void pace(std::int64_t steps) { per_step_ = steps > 0 ? (budget_ + steps - 1) / steps : budget_; }

  void step() {
    for (std::int64_t i = 0; i < per_step_ && budget_ > 0; ++i, --budget_) {
      if (at_ >= end_) {
        if (++row_ >= n_rows_) {
          budget_ = 0;
          return;
        }
        const auto start = reinterpret_cast<std::uintptr_t>(rows_[row_]);
        at_ = start & ~std::uintptr_t(63);
        end_ = start + bytes_;
      }
      _mm_prefetch(reinterpret_cast<const char*>(at_), _MM_HINT_T1);
      at_ += 64;
    }
  }

 private:
  const char* const* rows_ = nullptr;
  std::int64_t bytes_ = 0, n_rows_ = 0, row_ = -1;
  std::uintptr_t at_ = 0, end_ = 0;  // the open row: lines at_, at_ + 64, ... below end_
  std::int64_t budget_ = 0, per_step_ = 0;
};

}  // namespace
}  // namespace dsa::cpu
