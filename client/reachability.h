// Why a client's channel to the daemon did not become ready, said so that the reader knows
// what to do: a plaintext client on a port that speaks TLS, a TLS client on a plaintext port,
// a TLS handshake that fails with this client's credentials, or nothing listening. It
// probes the port once (a TCP connect, then a TLS handshake that verifies nothing) within
// min(2 s, max(waited, 0.5 s)). The Python client says the same (kvcd/_core.py,
// unreachable_message).
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace kvcd {

enum class PortSpeaks { kNothing, kPlaintext, kTls };

// Connects to host:port and tries a TLS handshake: kTls when it completes, kPlaintext when
// the peer answers but not with TLS, kNothing when no connection is accepted.
PortSpeaks ProbePort(const std::string& host, int port, std::chrono::milliseconds timeout);

// "host:port", "dns:///host:port", "ipv4:host:port", "[::1]:port" -> host and port;
// nullopt for targets without a TCP port (unix:, names without a port).
std::optional<std::pair<std::string, int>> TargetHostPort(const std::string& target);

// "cannot connect to kvcd at TARGET within N ms", then the cause and what to do.
std::string UnreachableMessage(const std::string& target, bool uses_tls,
                               std::chrono::milliseconds waited);

}  // namespace kvcd
