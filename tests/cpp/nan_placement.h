// Shared by the attention tests that put NaN and infinities into the data: the
// fused result must hold them exactly where the reference does.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace dsa_testing {

// NaN in `got` exactly where `ref` has NaN, infinities equal, the finite numbers
// within atol + rtol * (largest finite |ref|). Returns how many NaN `ref` holds.
inline std::int64_t expect_same_non_finite(const std::vector<float>& got, const std::vector<float>& ref,
                                           double rtol, double atol, const std::string& what) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  if (got.size() != ref.size()) return 0;
  double scale = 0.0, worst = 0.0;
  for (float y : ref)
    if (std::isfinite(y)) scale = std::max(scale, std::fabs(static_cast<double>(y)));
  std::int64_t nans = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const float x = got[i], y = ref[i];
    if (std::isnan(x) != std::isnan(y) || ((std::isinf(x) || std::isinf(y)) && x != y)) {
      ADD_FAILURE() << what << " at " << i << ": " << x << " vs " << y;
      return nans;
    }
    if (std::isnan(y)) {
      ++nans;
    } else if (!std::isinf(y)) {
      worst = std::max(worst, std::fabs(static_cast<double>(x) - y));
    }
  }
  EXPECT_LE(worst, atol + rtol * scale) << what << " (scale " << scale << ")";
  return nans;
}

}  // namespace dsa_testing
