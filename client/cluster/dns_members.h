// The members of a cluster without etcd (docs/cluster.md, `cluster.membership: dns`), as the
// cluster client reads them: the A/AAAA records of a name (a Kubernetes headless Service),
// each address on the members' gRPC port asked for its Stats, which names the member (id,
// incarnation, backend, capacity). An answer is checked as an etcd value would be
// (member_info.h); an address that does not answer, or answers with a value that breaks a
// rule, is no member and is counted. The daemon's own DNS membership does the same
// (server/cluster/dns_membership.h); the Python twin is kvcd.cluster.DnsMembership.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "server/cluster/member_info.h"

namespace kvcd::cluster {

struct DnsSource {
  std::string name;  // resolved every refresh
  int port = 0;      // the members' gRPC port
  // How the members are called (TLS, token, deadline); target is set per address.
  ClientOptions client;
  std::chrono::milliseconds refresh{5000};
};

// At most this many addresses are asked per resolution.
inline constexpr size_t kMaxDnsMembers = 1024;

// One resolution: the members by id. NOT_FOUND when the name does not resolve; `rejected`
// counts the addresses skipped.
absl::StatusOr<std::map<std::string, MemberInfo>> ResolveDnsMembers(const DnsSource& source,
                                                                    int64_t* rejected);

}  // namespace kvcd::cluster
