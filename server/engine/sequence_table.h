// SequenceTable: the one owner of the daemon's open sequences — ids (random 64-bit values,
// unguessable and not reused across restarts), leases, the max_sequences bound, the
// per-tenant quotas on them (config.h TenantQuota: open sequences, pages held, lease
// length) — and the lease policy every leased object (sequences, CUDA IPC buffers,
// decode channels) is granted by. A sequence's tenant is its cache_salt.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/steady_clock.h"
#include "server/cache/model_cache.h"
#include "server/cache/sequence.h"
#include "server/config/config.h"

namespace kvcd {

struct LeasePolicy {
  int64_t default_ms = 30000;
  int64_t max_ms = 600000;
  // The lease for a request: 0 = the default; INVALID_ARGUMENT outside 10..max_ms.
  absl::StatusOr<int64_t> Grant(int64_t requested_ms) const;
};

// What one tenant holds now, beside its quota (Stats, /metrics).
struct TenantUsage {
  std::string tenant;
  int64_t open_sequences = 0;
  int64_t pinned_pages = 0;
  TenantQuota quota;
  // Filled by CacheEngine: pages held in all models' pools (ModelCache owners), and the
  // models registered under the tenant with their pool bytes.
  int64_t held_pages = 0;
  int64_t registered_models = 0;
  uint64_t registered_model_bytes = 0;
};

class SequenceTable {
 public:
  SequenceTable(LeasePolicy leases, int64_t max_sequences, TenantQuotaConfig quotas = {})
      : leases_(leases), max_sequences_(max_sequences), quotas_(std::move(quotas)) {}
  // Closes every sequence still open.
  ~SequenceTable();

  const LeasePolicy& leases() const { return leases_; }

  // The lease for a request of `tenant`: LeasePolicy::Grant, then at most the tenant's
  // max_lease_ms (a longer request is granted the cap; the answer says what was granted).
  absl::StatusOr<int64_t> GrantLease(const std::string& tenant, int64_t requested_ms) const;

  // Opens a sequence of `model` on the cached prefix of `tokens` with a lease of lease_ms
  // (already granted). RESOURCE_EXHAUSTED at max_sequences, or when the tenant is at its
  // max_sequences quota or the pinned prefix would take it past max_pinned_pages (the
  // message names the quota); nothing stays pinned then.
  absl::StatusOr<std::shared_ptr<Sequence>> Open(ModelCache* model, const std::string& salt,
                                                 absl::Span<const int32_t> tokens,
                                                 int64_t lease_ms);
  // NOT_FOUND unless open; refreshes the lease of a found sequence.
  absl::StatusOr<std::shared_ptr<Sequence>> Find(uint64_t id);
  // The tenant (cache_salt) of an open sequence, without touching its lease; NOT_FOUND with
  // Find's message otherwise.
  absl::StatusOr<std::string> Salt(uint64_t id) const;
  // Removes and closes it; its length before closing.
  absl::StatusOr<int64_t> Close(uint64_t id);
  // Sets a new lease (0 keeps the current one, capped by GrantLease) and refreshes it;
  // the lease in force.
  absl::StatusOr<int64_t> Renew(uint64_t id, int64_t lease_ms);
  // Before a call that may grow `seq` to total_pages pages: RESOURCE_EXHAUSTED naming
  // max_pinned_pages if its tenant would hold more than the quota (nothing reserved),
  // else reserves the growth. Settle() then records the pages it really holds.
  absl::Status ReservePages(const Sequence& seq, int64_t total_pages);
  void Settle(const Sequence& seq, int64_t total_pages);
  // Every tenant with open sequences or a configured quota, by name.
  std::vector<TenantUsage> Usage() const;
  // Closes the sequences whose lease ran out before now_ns; how many.
  int Expire(int64_t now_ns);
  int64_t size() const;

 private:
  absl::StatusOr<std::shared_ptr<Sequence>> Get(uint64_t id) const;
  static void Touch(Sequence* seq);

  struct Held {
    int64_t sequences = 0;  // open, or being opened
    int64_t pages = 0;
  };
  // Removes a closed sequence's share from its tenant. REQUIRES: mu_ held.
  void ReleaseLocked(const Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LeasePolicy leases_;
  const int64_t max_sequences_;
  const TenantQuotaConfig quotas_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  int64_t opening_ ABSL_GUARDED_BY(mu_) = 0;  // Open calls between their check and insert
  std::map<std::string, Held> tenants_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, int64_t> pages_ ABSL_GUARDED_BY(mu_);  // per sequence
};

}  // namespace kvcd
