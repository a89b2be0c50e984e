// How a daemon calls its peers (PullPrefix, DNS membership's Stats): plaintext, or TLS when
// it serves TLS itself, trusting tls.client_ca_file (which, with mutual TLS, also signs the
// daemons' certificates) and presenting its own certificate.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/statusor.h"
#include "server/config/config.h"

namespace kvcd {

// INVALID_ARGUMENT naming the file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentials(const ServerConfig& c);

}  // namespace kvcd
