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
// Use: the kernel lists the next block's rows (spans), gives each product a
// share of their lines (budget), and each product engine calls pace(steps)
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
  // Rows r < n_rows: main_bytes from main[r], and rope_bytes from rope[r] when
  // rope is given and rope[r] does not follow the main bytes directly.
  void reset(const char* const* main, std::int64_t main_bytes, const char* const* rope, std::int64_t rope_bytes,
             std::int64_t n_rows) {
    main_ = main;
    rope_ = rope;
    main_bytes_ = main_bytes;
    rope_bytes_ = rope ? rope_bytes : 0;
    n_rows_ = n_rows;
    row_ = -1;
    at_ = end_ = 0;
    on_rope_ = true;  // so that the first advance opens row 0's main span
    budget_ = per_step_ = 0;
  }

  // Lines of the rows the next product should ask for, over all its steps.
  void budget(std::int64_t lines) { budget_ = lines; }

  // Called by a product before its first step: it will call step() `steps` times.
  void pace(std::int64_t steps) {
    per_step_ = steps > 0 ? (budget_ + steps - 1) / steps : budget_;
  }

  void step() {
    for (std::int64_t i = 0; i < per_step_ && budget_ > 0; ++i, --budget_) {
      if (at_ >= end_ && !advance()) {
        budget_ = 0;
        return;
      }
      _mm_prefetch(reinterpret_cast<const char*>(at_), _MM_HINT_T1);
      at_ += 64;
    }
  }

 private:
  // Opens the next span with bytes in it; false when the rows are done.
  bool advance() {
    while (true) {
      if (!on_rope_ && rope_bytes_ > 0) {
        on_rope_ = true;
        const auto rope = reinterpret_cast<std::uintptr_t>(rope_[row_]);
        const auto main = reinterpret_cast<std::uintptr_t>(main_[row_]);
        if (rope >= main && rope < at_) {  // the rope follows the main bytes: only its lines past them
          if (rope + rope_bytes_ > at_) {
            end_ = rope + rope_bytes_;
            return true;
          }
          continue;
        }
        open(rope, rope_bytes_);
        return true;
      }
      if (++row_ >= n_rows_) return false;
      on_rope_ = false;
      if (main_bytes_ > 0) {
        open(reinterpret_cast<std::uintptr_t>(main_[row_]), main_bytes_);
        return true;
      }
    }
  }

  void open(std::uintptr_t start, std::int64_t bytes) {
    at_ = start & ~std::uintptr_t(63);
    end_ = start + bytes;
  }

  const char* const* main_ = nullptr;
  const char* const* rope_ = nullptr;
  std::int64_t main_bytes_ = 0, rope_bytes_ = 0, n_rows_ = 0, row_ = -1;
  std::uintptr_t at_ = 0, end_ = 0;  // the open span: lines at_, at_ + 64, ... below end_
  bool on_rope_ = true;
  std::int64_t budget_ = 0, per_step_ = 0;
};

}  // namespace
}  // namespace dsa::cpu
