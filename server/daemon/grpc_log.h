// gRPC core's own log lines (a failed TLS handshake from a plaintext client, a connection
// reset, ...) in the daemon's log: the same time, level and format (common/log.h) instead of
// gRPC's, and rate limited like protobuf's (server/daemon/protobuf_log.h): a client retrying
// a handshake in a loop must not flood the log.
//
// Thread safety: Install once at start-up, before serving; the handler is thread-safe.
#pragma once

namespace kvcd {

// Routes gRPC core's log (gpr_log) into the daemon's log, at most 10 lines per 10 s.
void InstallRateLimitedGrpcLog();

}  // namespace kvcd
