// The one place where absl::Status crosses the RPC edge. absl status codes are the
// google.rpc.Code set, so the mapping keeps the code and the message; RESOURCE_EXHAUSTED
// additionally carries a retry hint in gRPC's standard "grpc-retry-pushback-ms" trailer.
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace kvcd {

grpc::Status ToGrpcStatus(const absl::Status& s);

// Milliseconds a client should wait before retrying a RESOURCE_EXHAUSTED call.
inline constexpr int kRetryAfterMs = 50;
inline constexpr char kRetryPushbackKey[] = "grpc-retry-pushback-ms";

}  // namespace kvcd
