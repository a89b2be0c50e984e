#include "client/cluster/member_directory.h"

#include "absl/strings/str_cat.h"

namespace kvcd::cluster {
namespace {
constexpr size_t kMaxMembers = 4096;
}  // namespace

MemberDirectory::MemberDirectory(std::vector<std::string> endpoints, std::string prefix)
    : etcd_(std::make_unique<EtcdClient>(std::move(endpoints))), prefix_(std::move(prefix)) {}

MemberDirectory::MemberDirectory(DnsSource dns) : dns_(std::move(dns)) {}

absl::StatusOr<std::unique_ptr<MemberDirectory>> MemberDirectory::ConnectDns(DnsSource source) {
  if (source.name.empty()) {
    return absl::InvalidArgumentError("cluster DNS name: a name to resolve is needed");
  }
  if (source.refresh < std::chrono::milliseconds(100)) {
    return absl::InvalidArgumentError("cluster DNS refresh: at least 100 ms");
  }
  std::unique_ptr<MemberDirectory> d(new MemberDirectory(std::move(source)));
  if (absl::Status s = d->Resolve(); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("cluster membership: ", s.message()));
  }
  d->thread_ = std::thread([p = d.get()] { p->DnsLoop(); });
  return d;
}

absl::Status MemberDirectory::Resolve() {
  int64_t rejected = 0;
  absl::StatusOr<Members> m = ResolveDnsMembers(dns_, &rejected);
  rejected_ += rejected;
  if (!m.ok()) return m.status();  // the last view stays (a resolver hiccup is no departure)
  {
    std::lock_guard<std::mutex> lock(mu_);
    members_ = *std::move(m);
  }
  changed_.notify_all();
  return absl::OkStatus();
}

void MemberDirectory::DnsLoop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (changed_.wait_for(lock, dns_.refresh, [&] { return stop_.load(); })) return;
    }
    Resolve().IgnoreError();
  }
}

absl::StatusOr<std::unique_ptr<MemberDirectory>> MemberDirectory::Connect(
    std::vector<std::string> etcd_endpoints, const std::string& cluster_name) {
  if (etcd_endpoints.empty()) {
    return absl::InvalidArgumentError("etcd endpoints: at least one host:port is needed");
  }
  std::unique_ptr<MemberDirectory> d(new MemberDirectory(
      std::move(etcd_endpoints), absl::StrCat("/kvcd/", cluster_name, "/members/")));
  absl::StatusOr<int64_t> revision = d->Range();
  if (!revision.ok()) return revision.status();
  d->thread_ = std::thread([p = d.get(), r = *revision] { p->Loop(r); });
  return d;
}

MemberDirectory::~MemberDirectory() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  changed_.notify_all();
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    if (watch_ != nullptr) watch_->Cancel();
  }
  if (thread_.joinable()) thread_.join();
}

void MemberDirectory::Apply(const std::string& key, const std::string& value, bool deleted,
                            Members* m) {
  if (key.compare(0, prefix_.size(), prefix_) != 0) {
    ++rejected_;
    return;
  }
  const std::string id = key.substr(prefix_.size());
  if (deleted) {
    m->erase(id);
    return;
  }
  absl::StatusOr<MemberInfo> info = DecodeMemberInfo(value, id);
  if (!info.ok()) {
    ++rejected_;
    m->erase(id);  // an unreadable value is no longer that member
    return;
  }
  if (m->count(id) != 0 || m->size() < kMaxMembers) (*m)[id] = *std::move(info);
}

absl::StatusOr<int64_t> MemberDirectory::Range() {
  int64_t revision = 0;
  auto kvs = etcd_->RangePrefix(prefix_, kMaxMembers, &revision);
  if (!kvs.ok()) {
    return absl::UnavailableError(
        absl::StrCat("etcd range of ", prefix_, " failed: ", kvs.status().message()));
  }
  Members m;
  for (const EtcdKeyValue& kv : *kvs) Apply(kv.key, kv.value, false, &m);
  {
    std::lock_guard<std::mutex> lock(mu_);
    members_ = std::move(m);
  }
  changed_.notify_all();
  return revision;
}

void MemberDirectory::Loop(int64_t revision) {
  std::chrono::milliseconds backoff(50);
  while (!stop_) {
    auto watch = etcd_->WatchPrefix(prefix_, revision + 1);
    if (watch.ok()) {
      {
        std::lock_guard<std::mutex> lock(watch_mu_);
        watch_ = watch->get();
      }
      if (stop_) (*watch)->Cancel();
      etcdserverpb::WatchResponse resp;
      while ((*watch)->Next(&resp)) {
        if (resp.canceled() || resp.compact_revision() != 0) break;
        if (resp.events_size() == 0) continue;
        Members m = members();
        for (const auto& ev : resp.events()) {
          Apply(ev.kv().key(), ev.kv().value(), ev.type() == etcdserverpb::Event::DELETE, &m);
          revision = std::max(revision, ev.kv().mod_revision());
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          members_ = std::move(m);
        }
        changed_.notify_all();
      }
      std::lock_guard<std::mutex> lock(watch_mu_);
      watch_ = nullptr;
    }
    if (stop_) return;
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_for(lock, backoff, [&] { return stop_.load(); });
    lock.unlock();
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
    absl::StatusOr<int64_t> r = Range();
    if (r.ok()) {
      revision = *r;
      backoff = std::chrono::milliseconds(50);
    }
  }
}

MemberDirectory::Members MemberDirectory::members() const {
  std::lock_guard<std::mutex> lock(mu_);
  return members_;
}

bool MemberDirectory::WaitFor(const std::function<bool(const Members&)>& pred,
                              std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  return changed_.wait_for(lock, timeout, [&] { return pred(members_); });
}

}  // namespace kvcd::cluster
