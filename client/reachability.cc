#include "client/reachability.h"

#include <fcntl.h>
#include <netdb.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvcd {
namespace {

// A connected TCP socket to host:port within `timeout`, or -1.
int ConnectWithin(const std::string& host, int port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof(err);
      if (errno != EINPROGRESS || poll(&p, 1, static_cast<int>(timeout.count())) != 1 ||
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
        close(fd);
        fd = -1;
        continue;
      }
    }
    // Blocking again, with the same bound on every read and write of the handshake.
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    timeval tv{static_cast<time_t>(timeout.count() / 1000),
               static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }
  freeaddrinfo(found);
  return fd;
}

}  // namespace

PortSpeaks ProbePort(const std::string& host, int port, std::chrono::milliseconds timeout) {
  const int fd = ConnectWithin(host, port, timeout);
  if (fd < 0) return PortSpeaks::kNothing;
  PortSpeaks speaks = PortSpeaks::kPlaintext;
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (ctx != nullptr) {
    SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, nullptr);  // only whether it speaks TLS
    // gRPC servers accept only HTTP/2 over TLS: offer it, as a gRPC client would.
    static const unsigned char kAlpn[] = {2, 'h', '2'};
    SSL_CTX_set_alpn_protos(ctx, kAlpn, sizeof(kAlpn));
    SSL* ssl = SSL_new(ctx);
    if (ssl != nullptr) {
      SSL_set_fd(ssl, fd);
      if (!host.empty()) SSL_set_tlsext_host_name(ssl, host.c_str());
      if (SSL_connect(ssl) == 1) speaks = PortSpeaks::kTls;
      SSL_free(ssl);
    }
    SSL_CTX_free(ctx);
  }
  close(fd);
  return speaks;
}

std::optional<std::pair<std::string, int>> TargetHostPort(const std::string& target) {
  if (absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:")) {
    return std::nullopt;
  }
  std::string t = target;
  if (const size_t slashes = t.rfind("///"); slashes != std::string::npos) {
    t = t.substr(slashes + 3);
  } else if (absl::StartsWith(t, "ipv4:") || absl::StartsWith(t, "ipv6:")) {
    t = t.substr(5);
  }
  const size_t colon = t.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  int port = 0;
  if (!absl::SimpleAtoi(t.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return std::nullopt;
  }
  std::string host = t.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) host = "localhost";
  return std::make_pair(host, port);
}

std::string UnreachableMessage(const std::string& target, bool uses_tls,
                               std::chrono::milliseconds waited) {
  const std::string base =
      absl::StrCat("cannot connect to kvcd at ", target, " within ", waited.count(), " ms");
  const auto hp = TargetHostPort(target);
  if (!hp) return base;
  const auto probe =
      std::clamp(waited, std::chrono::milliseconds(500), std::chrono::milliseconds(2000));
  switch (ProbePort(hp->first, hp->second, probe)) {
    case PortSpeaks::kNothing:
      return absl::StrCat(base, ": nothing accepts connections on ", hp->first, ":", hp->second,
                          " (is the daemon running, and is this its address?)");
    case PortSpeaks::kTls:
      if (!uses_tls) {
        return absl::StrCat(base,
                            ": the port speaks TLS but this client connects in plaintext; the "
                            "server may require TLS: give the CA that signed its certificate "
                            "(kvctl --tls-ca FILE or KVCD_TLS_CA; ClientOptions::"
                            "tls_root_ca_file, or ClientOptions::tls for the system roots)");
      }
      return absl::StrCat(base,
                          ": the TLS handshake does not complete with this client's "
                          "credentials (check the CA file, the server name and, for mutual "
                          "TLS, the client certificate and key)");
    case PortSpeaks::kPlaintext:
      if (uses_tls) {
        return absl::StrCat(base,
                            ": the port answers but not with TLS, and this client uses TLS; "
                            "connect without the TLS options (a plaintext daemon) or enable "
                            "tls in the daemon's config");
      }
      return base;
  }
  return base;
}

}  // namespace kvcd
