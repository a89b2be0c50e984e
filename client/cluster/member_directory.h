// MemberDirectory: the live members of a cluster as the cluster client sees them
// (docs/cluster.md "Membership"). From etcd (Connect): one range of <prefix>/members/ through
// etcd's own v3 gRPC API (EtcdClient), then a watch from the next revision on a thread of its
// own; a broken or compacted watch starts over with a range. Values are decoded as hostile
// (DecodeMemberInfo): a value that breaks a rule is no member and is counted in rejected().
// Without etcd (ConnectDns, membership dns): the name's addresses asked for their Stats
// (dns_members.h), again every refresh interval on the thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cluster/dns_members.h"
#include "server/cluster/etcd_client.h"
#include "server/cluster/member_info.h"

namespace kvcd::cluster {

class MemberDirectory {
 public:
  using Members = std::map<std::string, MemberInfo>;  // by member id

  // UNAVAILABLE when the first range fails: a client never starts on an empty cluster by
  // mistake.
  static absl::StatusOr<std::unique_ptr<MemberDirectory>> Connect(
      std::vector<std::string> etcd_endpoints, const std::string& cluster_name);
  // UNAVAILABLE when the first resolution fails (the name does not resolve).
  static absl::StatusOr<std::unique_ptr<MemberDirectory>> ConnectDns(DnsSource source);
  ~MemberDirectory();

  Members members() const;
  // Waits until pred(members) holds (true) or `timeout` passes (false); woken by changes.
  bool WaitFor(const std::function<bool(const Members&)>& pred,
               std::chrono::milliseconds timeout) const;
  int64_t rejected() const { return rejected_.load(); }

 private:
  MemberDirectory(std::vector<std::string> endpoints, std::string prefix);
  explicit MemberDirectory(DnsSource dns);
  absl::StatusOr<int64_t> Range();  // replaces the members; returns the revision
  void Apply(const std::string& key, const std::string& value, bool deleted, Members* m);
  void Loop(int64_t revision);
  absl::Status Resolve();  // DNS: replaces the members
  void DnsLoop();

  std::unique_ptr<EtcdClient> etcd_;  // or null (DNS)
  std::string prefix_;                // /kvcd/<name>/members/
  DnsSource dns_;
  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
  Members members_;
  std::atomic<int64_t> rejected_{0};
  std::atomic<bool> stop_{false};
  std::mutex watch_mu_;
  EtcdClient::Watch* watch_ = nullptr;  // the live watch, to cancel on destruction
  std::thread thread_;
};

}  // namespace kvcd::cluster
