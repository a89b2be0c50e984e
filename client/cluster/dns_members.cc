#include "client/cluster/dns_members.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"

namespace kvcd::cluster {
namespace {

// host:port gRPC targets of the name's addresses (IPv6 in brackets), sorted, bounded.
absl::StatusOr<std::set<std::string>> Addresses(const std::string& name, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(name.c_str(), nullptr, &hints, &found);
  if (rc != 0) {
    return absl::NotFoundError(
        absl::StrCat("cluster DNS name '", name, "' does not resolve: ", gai_strerror(rc)));
  }
  std::set<std::string> out;
  for (const addrinfo* a = found; a != nullptr && out.size() < kMaxDnsMembers; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr, text,
                sizeof(text));
      out.insert(absl::StrCat(text, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                sizeof(text));
      out.insert(absl::StrCat("[", text, "]:", port));
    }
  }
  freeaddrinfo(found);
  return out;
}

}  // namespace

absl::StatusOr<std::map<std::string, MemberInfo>> ResolveDnsMembers(const DnsSource& source,
                                                                    int64_t* rejected) {
  if (source.port <= 0 || source.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster DNS port is ", source.port, ", expected 1..65535"));
  }
  absl::StatusOr<std::set<std::string>> addresses = Addresses(source.name, source.port);
  if (!addresses.ok()) return addresses.status();
  std::map<std::string, MemberInfo> members;
  for (const std::string& address : *addresses) {
    ClientOptions co = source.client;
    co.target = address;
    co.connect_timeout = std::min(co.connect_timeout, std::chrono::milliseconds(1000));
    co.deadline = std::min(co.deadline, std::chrono::milliseconds(2000));
    auto c = Client::Connect(co);
    absl::StatusOr<v1::StatsResponse> stats =
        c.ok() ? (*c)->Stats() : absl::StatusOr<v1::StatsResponse>(c.status());
    if (!stats.ok()) {
      ++*rejected;
      continue;
    }
    MemberInfo m;
    // A daemon without a cluster: section names no member: its address's host stands in.
    m.member_id =
        stats->member_id().empty() ? address.substr(0, address.rfind(':')) : stats->member_id();
    m.address = address;
    m.backend = stats->backend();
    m.capacity_pages = stats->pages_capacity();
    m.incarnation = stats->incarnation();
    m.version = stats->version();
    // Checked as an etcd value is: bounded, typed, the id a valid member id.
    absl::StatusOr<MemberInfo> checked = DecodeMemberInfo(EncodeMemberInfo(m), m.member_id);
    if (!checked.ok() || members.count(checked->member_id) != 0) {
      ++*rejected;
      continue;
    }
    members.emplace(checked->member_id, *std::move(checked));
  }
  return members;
}

}  // namespace kvcd::cluster
