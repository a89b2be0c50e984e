#include "server/cluster/peer_credentials.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace kvcd {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* key) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster: cannot read ", key, " '", path, "' for calls to peers"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentials(const ServerConfig& c) {
  if (!c.tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  if (!c.tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(c.tls.client_ca_file, "tls.client_ca_file");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
  }
  absl::StatusOr<std::string> cert = ReadPem(c.tls.cert_file, "tls.cert_file");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(c.tls.key_file, "tls.key_file");
  if (!key.ok()) return key.status();
  o.pem_cert_chain = *cert;
  o.pem_private_key = *key;
  return grpc::SslCredentials(o);
}

}  // namespace kvcd
