#include "server/engine/request_checks.h"

#include "absl/strings/str_cat.h"

namespace kvcd {

absl::Status CheckSalt(const std::string& salt) {
  if (salt.size() > kMaxSaltBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache_salt has ", salt.size(), " bytes, expected at most ", kMaxSaltBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckTokens(const google::protobuf::RepeatedField<int32_t>& tokens, const char* field,
                         bool allow_empty) {
  const int64_t n = tokens.size();
  if (n == 0 && !allow_empty) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty, expected at least 1 token"));
  }
  if (n > kMaxTokensPerCall) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", n, " tokens, expected at most ",
                                                   kMaxTokensPerCall, " per call"));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[static_cast<int>(i)] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] is ",
                                                     tokens[static_cast<int>(i)],
                                                     ", expected a non-negative token id"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcd
