// Finiteness of the floats a file hands to the daemon (codec files, key-transform profiles):
// every loader checks each tensor it reads before any other test of it, because a check
// written as std::max(worst, x) or x < bound passes NaN silently.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcd {

// Index of the first NaN or +-Inf in v, or -1.
inline int64_t FirstNonFinite(const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

// OK, or INVALID_ARGUMENT "<what> element <i> is nan, expected finite values".
inline absl::Status CheckFinite(absl::string_view what, const std::vector<float>& v) {
  const int64_t bad = FirstNonFinite(v);
  if (bad < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, " element ", bad, " is ", v[static_cast<size_t>(bad)], ", expected finite values"));
}

}  // namespace kvcd
