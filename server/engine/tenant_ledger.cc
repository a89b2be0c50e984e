#include "server/engine/tenant_ledger.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/quote.h"

namespace kvcd {
namespace {

absl::Status QuotaError(const std::string& tenant, const char* quota, int64_t limit,
                        const std::string& what, const char* remedy = "close sequences first") {
  return absl::ResourceExhaustedError(absl::StrCat("tenant ", Quote(tenant), " (cache_salt) ", what,
                                                   "; its quota ", quota, " is ", limit, "; ",
                                                   remedy));
}

}  // namespace

int64_t TenantLedger::CapLease(const std::string& tenant, int64_t lease_ms) const {
  const int64_t cap = Quota(tenant).max_lease_ms;
  return cap > 0 && lease_ms > cap ? cap : lease_ms;
}

absl::Status TenantLedger::TakeSequence(const std::string& tenant) {
  const TenantQuota& quota = Quota(tenant);
  std::lock_guard<std::mutex> lock(mu_);
  Held& held = held_[tenant];
  if (quota.max_sequences > 0 && held.sequences >= quota.max_sequences) {
    const int64_t now = held.sequences;
    DropIfEmptyLocked(held_.find(tenant));
    return QuotaError(tenant, "max_sequences", quota.max_sequences,
                      absl::StrCat("has ", now, " open sequences"));
  }
  ++held.sequences;
  return absl::OkStatus();
}

absl::Status TenantLedger::PinPages(const std::string& tenant, int64_t pages,
                                    absl::string_view needer) {
  const TenantQuota& quota = Quota(tenant);
  std::lock_guard<std::mutex> lock(mu_);
  Held& held = held_[tenant];
  if (quota.max_pinned_pages > 0 && held.pinned_pages + pages > quota.max_pinned_pages) {
    const int64_t now = held.pinned_pages;
    DropIfEmptyLocked(held_.find(tenant));
    return QuotaError(
        tenant, "max_pinned_pages", quota.max_pinned_pages,
        absl::StrCat("holds ", now, " pages and ", needer, " needs ", pages, " more"));
  }
  held.pinned_pages += pages;
  return absl::OkStatus();
}

void TenantLedger::AdjustPinned(const std::string& tenant, int64_t delta) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.try_emplace(tenant).first;
  it->second.pinned_pages += delta;
  DropIfEmptyLocked(it);
}

void TenantLedger::ReleaseSequence(const std::string& tenant, int64_t pinned_pages) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(tenant);
  if (it == held_.end()) return;
  --it->second.sequences;
  it->second.pinned_pages -= pinned_pages;
  DropIfEmptyLocked(it);
}

absl::Status TenantLedger::PinPrefixPages(const std::string& tenant, int64_t pages) {
  const TenantQuota& quota = Quota(tenant);
  std::lock_guard<std::mutex> lock(mu_);
  Held& held = held_[tenant];
  const int64_t limit = quota.max_pinned_prefix_pages;
  if (limit > 0 && (pages > limit || held.prefix_pages > limit - pages)) {
    const int64_t now = held.prefix_pages;
    DropIfEmptyLocked(held_.find(tenant));
    return QuotaError(tenant, "max_pinned_prefix_pages", limit,
                      absl::StrCat("has ", now,
                                   " pages pinned by its prefix pins and this pin "
                                   "needs ",
                                   pages, " more"),
                      "unpin prefixes (UnpinPrefix) or let their ttl run out first");
  }
  held.prefix_pages += pages;
  return absl::OkStatus();
}

void TenantLedger::ReleasePrefixPages(const std::string& tenant, int64_t pages) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(tenant);
  if (it == held_.end()) return;
  it->second.prefix_pages -= pages;
  DropIfEmptyLocked(it);
}

absl::Status TenantLedger::CheckRegistration(const std::string& tenant, const std::string& model,
                                             uint64_t memory_bytes, uint64_t* limit,
                                             std::string* limit_what) const {
  const TenantQuota& q = Quota(tenant);
  Held h;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(tenant);
    if (it != held_.end()) h = it->second;
  }
  if (q.max_models > 0 && h.models >= q.max_models) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant ", Quote(tenant), " has registered ", h.models, " models; its quota max_models is ",
        q.max_models, "; model ", Quote(model), " was not registered"));
  }
  if (q.max_model_bytes == 0) return absl::OkStatus();
  const uint64_t left = q.max_model_bytes - std::min(q.max_model_bytes, h.model_bytes);
  const std::string what =
      absl::StrCat("tenant ", Quote(tenant), "'s quota max_model_bytes ", q.max_model_bytes, " (",
                   h.model_bytes, " bytes registered already)");
  if (memory_bytes > left) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model ", Quote(model), " asks for memory_bytes ", memory_bytes, " but only ",
                     left, " bytes are left under ", what));
  }
  if (left < *limit) {
    *limit = left;
    *limit_what = what;
  }
  return absl::OkStatus();
}

void TenantLedger::AddRegistration(const std::string& tenant, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Held& h = held_[tenant];
  ++h.models;
  h.model_bytes += bytes;
}

absl::Status TenantLedger::TakeDecodeChannel(const std::vector<std::string>& tenants) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& tenant : tenants) {
    const int64_t limit = Quota(tenant).max_decode_channels;
    auto it = held_.find(tenant);
    const int64_t now = it == held_.end() ? 0 : it->second.decode_channels;
    if (limit > 0 && now >= limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tenant ", Quote(tenant), " (a tenant of the token) has ", now,
                       " decode channels open; its quota max_decode_channels is ", limit,
                       "; close channels first"));
    }
  }
  for (const std::string& tenant : tenants) ++held_[tenant].decode_channels;
  return absl::OkStatus();
}

void TenantLedger::ReleaseDecodeChannel(const std::vector<std::string>& tenants) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& tenant : tenants) {
    auto it = held_.find(tenant);
    if (it == held_.end()) continue;
    --it->second.decode_channels;
    DropIfEmptyLocked(it);
  }
}

std::vector<TenantUsage> TenantLedger::Usage() const {
  std::map<std::string, TenantUsage> all;
  for (const auto& [name, q] : quotas_.tenants) {
    TenantUsage& u = all[name];
    u.tenant = name;
    u.quota = q;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [name, h] : held_) {
      TenantUsage& u = all[name];
      u.tenant = name;
      u.quota = Quota(name);
      u.open_sequences = h.sequences;
      u.pinned_pages = h.pinned_pages;
      u.registered_models = h.models;
      u.registered_model_bytes = h.model_bytes;
      u.pinned_prefix_pages = h.prefix_pages;
      u.open_decode_channels = h.decode_channels;
    }
  }
  std::vector<TenantUsage> out;
  for (auto& [name, u] : all) out.push_back(std::move(u));
  return out;
}

void TenantLedger::DropIfEmptyLocked(std::map<std::string, Held>::iterator it) {
  if (it != held_.end() && it->second.empty()) held_.erase(it);
}

}  // namespace kvcd
