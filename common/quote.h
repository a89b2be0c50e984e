// Quoting client-controlled strings in error messages. A message that echoes a whole
// client string can outgrow gRPC's metadata limit (the client then sees
// RESOURCE_EXHAUSTED "metadata size exceeds limit" instead of the real error) and carries
// whatever bytes the client sent. Quote() keeps at most kMaxQuotedBytes, escapes
// non-printable bytes, and says how long the original was when it cuts.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcd {

inline constexpr size_t kMaxQuotedBytes = 64;

// 'name' for short strings, 'first 64 bytes...' (10240 bytes) for long ones.
inline std::string Quote(absl::string_view s) {
  if (s.size() <= kMaxQuotedBytes) return absl::StrCat("'", absl::CHexEscape(s), "'");
  return absl::StrCat("'", absl::CHexEscape(s.substr(0, kMaxQuotedBytes)), "...' (", s.size(),
                      " bytes)");
}

}  // namespace kvcd
