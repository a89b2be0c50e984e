#include "server/cluster/etcd_membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvcd {

const char* MembershipStateName(MembershipState s) {
  switch (s) {
    case MembershipState::kJoining:
      return "joining";
    case MembershipState::kAdvertised:
      return "advertised";
    case MembershipState::kLost:
      return "lost";
  }
  return "?";
}

EtcdMembership::EtcdMembership(const ClusterConfig& config, MemberInfo self)
    : config_(config),
      self_(std::move(self)),
      key_(config.MembersPrefix() + self_.member_id),
      // A call waits at most a third of the TTL, so that a hung etcd cannot hold the
      // keep-alive past the lease.
      etcd_(config.etcd_endpoints,
            std::chrono::milliseconds(std::max<int64_t>(200, config.lease_ttl_s * 1000 / 3))) {}

EtcdMembership::~EtcdMembership() { Stop(); }

void EtcdMembership::Start(Listener listener) {
  listener_ = std::move(listener);
  lease_thread_ = std::thread([this] { LeaseLoop(); });
  watch_thread_ = std::thread([this] { WatchLoop(); });
}

void EtcdMembership::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    if (watch_ != nullptr) watch_->Cancel();
  }
  cv_.notify_all();
  if (lease_thread_.joinable()) lease_thread_.join();
  if (watch_thread_.joinable()) watch_thread_.join();
  int64_t lease = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lease = lease_id_;
    lease_id_ = 0;
    state_ = MembershipState::kLost;
  }
  if (lease != 0) {
    // The key goes with its lease at once; peers see the delete and purge.
    if (absl::Status s = etcd_.LeaseRevoke(lease); !s.ok()) {
      KVCD_LOG(WARNING) << "cluster: revoking the lease at shutdown failed (the key goes when "
                           "the lease expires): "
                        << s;
    } else {
      KVCD_LOG(INFO) << "cluster: left (lease revoked, key " << key_ << " deleted)";
    }
  }
}

MembershipState EtcdMembership::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

std::vector<MemberInfo> EtcdMembership::Members() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<MemberInfo> out;
  out.reserve(members_.size());
  for (const auto& [id, m] : members_) out.push_back(m);
  return out;
}

std::optional<MemberInfo> EtcdMembership::Find(const std::string& member_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = members_.find(member_id);
  if (it == members_.end()) return std::nullopt;
  return it->second;
}

bool EtcdMembership::Pause(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, d, [this] { return stopping_; });
  return !stopping_;
}

void EtcdMembership::LeaseLoop() {
  const int64_t ttl_ms = int64_t{config_.lease_ttl_s} * 1000;
  const auto period = std::chrono::milliseconds(ttl_ms / 3);
  const std::string value = EncodeMemberInfo(self_);
  bool logged_failure = false;
  while (true) {
    int64_t lease = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      lease = lease_id_;
    }
    if (lease == 0) {
      // Register: a new lease, then the key under it.
      int64_t granted = 0;
      absl::StatusOr<int64_t> id = etcd_.LeaseGrant(config_.lease_ttl_s, &granted);
      absl::Status s = id.status();
      if (id.ok()) {
        s = etcd_.Put(key_, value, *id);
        if (!s.ok()) (void)etcd_.LeaseRevoke(*id);
      }
      if (!s.ok()) {
        if (!logged_failure) {
          KVCD_LOG(WARNING) << "cluster: cannot register " << key_ << " in etcd (retrying): " << s;
          logged_failure = true;
        }
        if (!Pause(std::min<std::chrono::milliseconds>(period, std::chrono::milliseconds(500))))
          return;
        continue;
      }
      logged_failure = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) {
          lease_id_ = *id;  // Stop() revokes it
          return;
        }
        lease_id_ = *id;
        state_ = MembershipState::kAdvertised;
      }
      const uint64_t generation = generation_.fetch_add(1) + 1;
      KVCD_LOG(INFO) << "cluster: advertised as " << key_ << " (incarnation " << self_.incarnation
                     << ", lease ttl " << granted << " s)";
      if (listener_.advertised) listener_.advertised(generation);
      continue;
    }
    if (!Pause(period)) return;
    absl::StatusOr<int64_t> ttl = etcd_.LeaseKeepAliveOnce(lease);
    if (ttl.ok() && *ttl > 0) continue;
    // The lease is gone (or its keep-alive failed): stop advertising at once, then register
    // again under a new lease. The incarnation stays: the pages are the same.
    KVCD_LOG(WARNING) << "cluster: lease lost ("
                      << (ttl.ok() ? std::string("etcd no longer knows it")
                                   : std::string(ttl.status().message()))
                      << "); not advertising until registered again";
    {
      std::lock_guard<std::mutex> lock(mu_);
      lease_id_ = 0;
      state_ = MembershipState::kLost;
    }
    leases_lost_.fetch_add(1);
    if (listener_.lost) listener_.lost();
    if (ttl.ok()) continue;  // etcd answers: register at once
    if (!Pause(std::min<std::chrono::milliseconds>(period, std::chrono::milliseconds(500)))) return;
  }
}

void EtcdMembership::WatchLoop() {
  while (WatchOnce()) {
    if (!Pause(std::chrono::milliseconds(500))) return;
  }
}

bool EtcdMembership::WatchOnce() {
  const std::string prefix = config_.MembersPrefix();
  int64_t revision = 0;
  absl::StatusOr<std::vector<EtcdKeyValue>> kvs =
      etcd_.RangePrefix(prefix, kMaxMembers + 1, &revision);
  if (!kvs.ok()) return true;
  if (kvs->size() > static_cast<size_t>(kMaxMembers)) {
    KVCD_LOG(WARNING) << "cluster: more than " << kMaxMembers << " keys under " << prefix
                      << "; reading the first " << kMaxMembers;
    kvs->resize(kMaxMembers);
  }
  std::map<std::string, MemberInfo> members;
  for (const EtcdKeyValue& kv : *kvs) {
    const std::string id = kv.key.substr(prefix.size());
    absl::StatusOr<MemberInfo> m = DecodeMemberInfo(kv.value, id);
    if (!m.ok()) {
      KVCD_LOG(WARNING) << "cluster: ignoring etcd key under " << prefix << ": " << m.status();
      continue;
    }
    members.emplace(id, std::move(*m));
  }
  SetMembers(std::move(members));
  absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> watch =
      etcd_.WatchPrefix(prefix, revision + 1);
  if (!watch.ok()) return true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    watch_ = watch->get();
  }
  etcdserverpb::WatchResponse resp;
  while ((*watch)->Next(&resp)) {
    if (resp.canceled() || resp.compact_revision() != 0) break;  // re-read from a Range
    for (const etcdserverpb::Event& e : resp.events()) Apply(e);
  }
  std::lock_guard<std::mutex> lock(mu_);
  watch_ = nullptr;
  return !stopping_;
}

void EtcdMembership::SetMembers(std::map<std::string, MemberInfo> members) {
  std::vector<MemberInfo> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, m] : members_) {
      const auto it = members.find(id);
      if (it == members.end() || it->second.incarnation != m.incarnation) gone.push_back(m);
    }
    members_ = std::move(members);
  }
  for (const MemberInfo& m : gone) Gone(m);
}

void EtcdMembership::Apply(const etcdserverpb::Event& e) {
  const std::string prefix = config_.MembersPrefix();
  const std::string& key = e.kv().key();
  if (key.size() <= prefix.size() || key.compare(0, prefix.size(), prefix) != 0) return;
  const std::string id = key.substr(prefix.size());
  std::optional<MemberInfo> gone;
  if (e.type() == etcdserverpb::Event::DELETE) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = members_.find(id);
    if (it != members_.end()) {
      gone = it->second;
      members_.erase(it);
    }
  } else {
    absl::StatusOr<MemberInfo> m = DecodeMemberInfo(e.kv().value(), id);
    if (!m.ok()) {
      KVCD_LOG(WARNING) << "cluster: ignoring etcd key " << key << ": " << m.status();
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = members_.emplace(id, *m);
    if (!inserted) {
      if (it->second.incarnation != m->incarnation) gone = it->second;  // it restarted
      it->second = std::move(*m);
    }
  }
  if (gone) Gone(*gone);
}

void EtcdMembership::Gone(const MemberInfo& m) {
  if (m.member_id == self_.member_id && m.incarnation == self_.incarnation) return;
  KVCD_LOG(INFO) << "cluster: member " << m.member_id << " (incarnation " << m.incarnation
                 << ") left";
  if (listener_.member_gone) listener_.member_gone(m);
}

}  // namespace kvcd
