// TenantLedger: what each tenant holds and may hold, in one place. A tenant is a
// cache_salt (RegisterModel: its `tenant` field); with auth on, the token must grant it
// (server/rpc/authorizer.h). The ledger keeps each tenant's quota (config.h TenantQuota)
// beside what it holds against it: open sequences, the pages they pin (a count; the pages
// themselves are the sequences'), its share of each model's page pools (ModelCache asks
// PoolShare and counts the pages), the models registered under it with their bytes, and the
// decode channels open with a token that grants it. The pages its prefix pins (PinPrefix)
// hold count against max_pinned_prefix_pages, per pin: a page under two of the tenant's
// pins counts twice. The sequence table, the prefix-pin table, the engine's registrations,
// the decode channels and the model caches consult it; no one else reads the quotas.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/config/config.h"

namespace kvcd {

// What one tenant holds now, beside its quota (Stats, /metrics).
struct TenantUsage {
  std::string tenant;
  int64_t open_sequences = 0;
  int64_t pinned_pages = 0;
  TenantQuota quota;
  // Pages held in all models' pools (counted by each ModelCache; filled by CacheEngine).
  int64_t held_pages = 0;
  int64_t registered_models = 0;
  uint64_t registered_model_bytes = 0;
  int64_t pinned_prefix_pages = 0;  // held by its live prefix pins (summed over the pins)
  int64_t open_decode_channels = 0;
};

class TenantLedger {
 public:
  explicit TenantLedger(TenantQuotaConfig quotas = {}) : quotas_(std::move(quotas)) {}

  const TenantQuota& Quota(const std::string& tenant) const { return quotas_.For(tenant); }
  // The fraction of each page pool the tenant's pages may take (max_memory_share).
  double PoolShare(const std::string& tenant) const { return Quota(tenant).max_memory_share; }
  // A lease already within the daemon's policy, capped at the tenant's max_lease_ms.
  int64_t CapLease(const std::string& tenant, int64_t lease_ms) const;

  // One more open sequence: RESOURCE_EXHAUSTED naming max_sequences at the quota.
  absl::Status TakeSequence(const std::string& tenant);
  // `pages` more pinned pages: RESOURCE_EXHAUSTED naming max_pinned_pages if the tenant
  // would hold more than its quota ("holds N pages and <needer> needs `pages` more"),
  // nothing taken then.
  absl::Status PinPages(const std::string& tenant, int64_t pages, absl::string_view needer);
  // Records pages pinned or unpinned without a check (a call settling what it holds).
  void AdjustPinned(const std::string& tenant, int64_t delta);
  // A sequence closes (or is refused while opening) and gives back its pinned pages.
  void ReleaseSequence(const std::string& tenant, int64_t pinned_pages);

  // A prefix pin of `pages` pages: RESOURCE_EXHAUSTED naming max_pinned_prefix_pages, its
  // value and what the tenant's pins hold already, if the pins would hold more than the
  // quota; nothing taken then.
  absl::Status PinPrefixPages(const std::string& tenant, int64_t pages);
  // A prefix pin is removed (UnpinPrefix) or expires.
  void ReleasePrefixPages(const std::string& tenant, int64_t pages);

  // Before registering a model of memory_bytes for `tenant`: RESOURCE_EXHAUSTED naming
  // max_models or max_model_bytes. Lowers *limit to what the tenant has left under
  // max_model_bytes when that is the tighter bound, and then says why in *limit_what
  // (ModelCache::Create names it when the rounded pools do not fit).
  absl::Status CheckRegistration(const std::string& tenant, const std::string& model,
                                 uint64_t memory_bytes, uint64_t* limit,
                                 std::string* limit_what) const;
  void AddRegistration(const std::string& tenant, uint64_t bytes);

  // One more decode channel for each of `tenants` (the tenants its token grants), all or
  // none: RESOURCE_EXHAUSTED naming max_decode_channels and the first tenant at its quota.
  absl::Status TakeDecodeChannel(const std::vector<std::string>& tenants);
  void ReleaseDecodeChannel(const std::vector<std::string>& tenants);

  // Every tenant with a configured quota, open sequences or registrations, by name.
  std::vector<TenantUsage> Usage() const;

 private:
  struct Held {
    int64_t sequences = 0;  // open, or being opened
    int64_t pinned_pages = 0;
    int64_t models = 0;
    uint64_t model_bytes = 0;  // allocated
    int64_t prefix_pages = 0;  // held by prefix pins
    int64_t decode_channels = 0;
    bool empty() const {
      return sequences == 0 && pinned_pages == 0 && models == 0 && prefix_pages == 0 &&
             decode_channels == 0;
    }
  };
  void DropIfEmptyLocked(std::map<std::string, Held>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TenantQuotaConfig quotas_;
  mutable std::mutex mu_;
  std::map<std::string, Held> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcd
