// TLS for the gRPC API port (config `tls`); the health-only port stays plaintext.
//
// gRPC 1.51 (Debian 12) cannot swap the credentials of a running server, but its
// grpc::experimental::FileWatcherCertificateProvider re-reads PEM files periodically and
// uses new contents for new connections. It would also pick up a half-written or broken
// file, so kvcd never points it at the operator's files: TlsCredentialSource checks the
// configured files with OpenSSL (certificate chain parses, key parses and matches the
// certificate, client CA bundle parses) and copies only contents that pass into a
// private staging directory (mode 0700, removed at shutdown), which gRPC watches.
// Broken contents are logged and the previous credentials stay in force.
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "server/config/config.h"

namespace kvcd {

// Reads and checks the configured files. NOT_FOUND / INVALID_ARGUMENT name the file
// (and its config key) and say what was expected.
absl::Status CheckTlsFiles(const TlsConfig& tls);

class TlsCredentialSource {
 public:
  // Checks the files and stages them; errors as CheckTlsFiles, INTERNAL if the staging
  // directory cannot be written.
  static absl::StatusOr<std::unique_ptr<TlsCredentialSource>> Create(const TlsConfig& tls);
  ~TlsCredentialSource();  // removes the staging directory

  // Server credentials watching the staged copies. With client_ca_file the server
  // requires and verifies a client certificate (mutual TLS).
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;

  // Checks the configured files once reload_interval_s has passed since the last check.
  // Returns a line for the daemon's log when they changed ("" otherwise): staged, or
  // broken and ignored (the previous credentials stay in force).
  std::string Poll();

  // The private directory gRPC reads the checked copies from.
  const std::string& staging_dir() const { return dir_; }

 private:
  explicit TlsCredentialSource(const TlsConfig& tls) : tls_(tls) {}
  // Checks the configured files and copies them on success.
  absl::Status Stage() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TlsConfig tls_;
  TlsConfig staged_;  // the same settings, pointing at the staged copies
  std::string dir_;
  std::mutex mu_;
  std::string last_ ABSL_GUARDED_BY(mu_);  // fingerprint of the files at the last check
  int64_t next_check_ns_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcd
