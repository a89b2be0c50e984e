#include "server/engine/sequence_table.h"

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/random_id.h"

namespace kvcd {

absl::StatusOr<int64_t> LeasePolicy::Grant(int64_t requested_ms) const {
  if (requested_ms == 0) return default_ms;
  if (requested_ms < 10 || requested_ms > max_ms) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms is ", requested_ms, ", expected 0 (default) or 10..", max_ms));
  }
  return requested_ms;
}

SequenceTable::~SequenceTable() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, seq] : sequences_) seq->model->Close(seq.get());
  sequences_.clear();
  tenants_.clear();
  pages_.clear();
}

void SequenceTable::Touch(Sequence* seq) {
  seq->deadline_ns.store(SteadyNowNs() + seq->lease_ms.load() * 1000000);
}

namespace {

int64_t PagesOf(ModelCache* model, Sequence* seq) {
  const int64_t ps = model->spec().page_size;
  return (model->Length(seq) + ps - 1) / ps;
}

absl::Status QuotaError(const std::string& tenant, const char* quota, int64_t limit,
                        const std::string& what) {
  return absl::ResourceExhaustedError(absl::StrCat("tenant ", Quote(tenant), " (cache_salt) ", what,
                                                   "; its quota ", quota, " is ", limit,
                                                   "; close sequences first"));
}

}  // namespace

absl::StatusOr<int64_t> SequenceTable::GrantLease(const std::string& tenant,
                                                  int64_t requested_ms) const {
  absl::StatusOr<int64_t> lease = leases_.Grant(requested_ms);
  if (!lease.ok()) return lease;
  const int64_t cap = quotas_.For(tenant).max_lease_ms;
  return cap > 0 && *lease > cap ? cap : *lease;
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Open(ModelCache* model,
                                                              const std::string& salt,
                                                              absl::Span<const int32_t> tokens,
                                                              int64_t lease_ms) {
  const TenantQuota& quota = quotas_.For(salt);
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int64_t>(sequences_.size()) + opening_ >= max_sequences_) {
      return absl::ResourceExhaustedError(absl::StrCat("max_sequences (", max_sequences_,
                                                       ") sequences are open; close some first"));
    }
    Held& held = tenants_[salt];
    if (quota.max_sequences > 0 && held.sequences >= quota.max_sequences) {
      return QuotaError(salt, "max_sequences", quota.max_sequences,
                        absl::StrCat("has ", held.sequences, " open sequences"));
    }
    ++held.sequences;  // the slot is taken while the prefix is pinned
    ++opening_;
    do {
      id = RandomId64();
    } while (sequences_.count(id) != 0);
  }
  std::shared_ptr<Sequence> seq = model->Open(id, salt, tokens);
  const int64_t pages = PagesOf(model, seq.get());
  seq->lease_ms.store(lease_ms);
  Touch(seq.get());
  std::unique_lock<std::mutex> lock(mu_);
  --opening_;
  Held& held = tenants_[salt];
  if (quota.max_pinned_pages > 0 && held.pages + pages > quota.max_pinned_pages) {
    --held.sequences;
    const int64_t now = held.pages;
    lock.unlock();
    model->Close(seq.get());
    return QuotaError(
        salt, "max_pinned_pages", quota.max_pinned_pages,
        absl::StrCat("holds ", now, " pages and the matched prefix needs ", pages, " more"));
  }
  held.pages += pages;
  pages_[id] = pages;
  sequences_.emplace(id, seq);
  return seq;
}

absl::Status SequenceTable::ReservePages(const Sequence& seq, int64_t total_pages) {
  const TenantQuota& quota = quotas_.For(seq.salt);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pages_.find(seq.id);
  if (it == pages_.end()) return absl::OkStatus();  // closed meanwhile: the call will say so
  const int64_t growth = total_pages - it->second;
  if (growth <= 0) return absl::OkStatus();
  Held& held = tenants_[seq.salt];
  if (quota.max_pinned_pages > 0 && held.pages + growth > quota.max_pinned_pages) {
    return QuotaError(
        seq.salt, "max_pinned_pages", quota.max_pinned_pages,
        absl::StrCat("holds ", held.pages, " pages and this call needs ", growth, " more"));
  }
  held.pages += growth;
  it->second = total_pages;
  return absl::OkStatus();
}

void SequenceTable::Settle(const Sequence& seq, int64_t total_pages) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pages_.find(seq.id);
  if (it == pages_.end()) return;
  tenants_[seq.salt].pages += total_pages - it->second;
  it->second = total_pages;
}

void SequenceTable::ReleaseLocked(const Sequence& seq) {
  auto t = tenants_.find(seq.salt);
  auto p = pages_.find(seq.id);
  if (t != tenants_.end()) {
    --t->second.sequences;
    if (p != pages_.end()) t->second.pages -= p->second;
    if (t->second.sequences == 0) tenants_.erase(t);
  }
  if (p != pages_.end()) pages_.erase(p);
}

std::vector<TenantUsage> SequenceTable::Usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, TenantUsage> all;
  for (const auto& [name, q] : quotas_.tenants) all[name] = TenantUsage{name, 0, 0, q};
  for (const auto& [name, h] : tenants_) {
    TenantUsage& u = all[name];
    u.tenant = name;
    u.open_sequences = h.sequences;
    u.pinned_pages = h.pages;
    u.quota = quotas_.For(name);
  }
  std::vector<TenantUsage> out;
  for (auto& [name, u] : all) out.push_back(std::move(u));
  return out;
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Get(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("sequence ", id, " is not open (never opened, closed, or its lease expired)"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Find(uint64_t id) {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = Get(id);
  if (seq.ok()) Touch(seq->get());
  return seq;
}

absl::StatusOr<std::string> SequenceTable::Salt(uint64_t id) const {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = Get(id);
  if (!seq.ok()) return seq.status();
  return (*seq)->salt;
}

absl::StatusOr<int64_t> SequenceTable::Close(uint64_t id) {
  std::shared_ptr<Sequence> seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sequences_.find(id);
    if (it == sequences_.end()) {
      return absl::NotFoundError(absl::StrCat("sequence ", id, " is not open"));
    }
    seq = it->second;
    sequences_.erase(it);
    ReleaseLocked(*seq);
  }
  const int64_t len = seq->model->Length(seq.get());
  seq->model->Close(seq.get());
  return len;
}

absl::StatusOr<int64_t> SequenceTable::Renew(uint64_t id, int64_t lease_ms) {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = Get(id);
  if (!seq.ok()) return seq.status();
  if (lease_ms != 0) {
    absl::StatusOr<int64_t> lease = GrantLease((*seq)->salt, lease_ms);
    if (!lease.ok()) return lease.status();
    (*seq)->lease_ms.store(*lease);
  }
  Touch(seq->get());
  return (*seq)->lease_ms.load();
}

int SequenceTable::Expire(int64_t now_ns) {
  std::vector<std::shared_ptr<Sequence>> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sequences_.begin(); it != sequences_.end();) {
      if (it->second->deadline_ns.load() < now_ns) {
        expired.push_back(it->second);
        ReleaseLocked(*it->second);
        it = sequences_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& seq : expired) seq->model->Close(seq.get());
  return static_cast<int>(expired.size());
}

int64_t SequenceTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(sequences_.size());
}

}  // namespace kvcd
