// The bounds every request's plain fields are checked against before anything is routed:
// cache_salt length, token lists, batch size, softmax_scale.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "google/protobuf/repeated_field.h"

namespace kvcd {

constexpr int64_t kMaxTokensPerCall = int64_t{1} << 24;
constexpr int kMaxSaltBytes = 256;
constexpr int kMaxBatch = 1024;
// The largest AttentionDecode softmax_scale (docs/api.md): 1/sqrt(head_dim) and 1, the
// scales models use, with room to spare; at 3e38 the FP32 scores overflowed (lse = +Inf).
constexpr float kMaxSoftmaxScale = 64.0f;

// INVALID_ARGUMENT if a cache_salt is longer than kMaxSaltBytes.
absl::Status CheckSalt(const std::string& salt);
// INVALID_ARGUMENT for an empty list (unless allow_empty), more than kMaxTokensPerCall
// tokens, or a negative token id (named by its index in `field`).
absl::Status CheckTokens(const google::protobuf::RepeatedField<int32_t>& tokens, const char* field,
                         bool allow_empty);

}  // namespace kvcd
