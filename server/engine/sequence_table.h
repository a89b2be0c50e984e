// SequenceTable: the one owner of the daemon's open sequences — ids (random 64-bit values,
// unguessable and not reused across restarts), leases, the max_sequences bound, the pages
// each one pins — and the lease policy every leased object (sequences, CUDA IPC buffers,
// decode channels) is granted by. A sequence's tenant is its cache_salt; what the tenant
// may hold (open sequences, pinned pages, lease length) is asked of the TenantLedger, which
// the table tells what each tenant's sequences hold.
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
#include "server/engine/tenant_ledger.h"

namespace kvcd {

struct LeasePolicy {
  int64_t default_ms = 30000;
  int64_t max_ms = 600000;
  // The lease for a request: 0 = the default; INVALID_ARGUMENT outside 10..max_ms.
  absl::StatusOr<int64_t> Grant(int64_t requested_ms) const;
};

class SequenceTable {
 public:
  // ledger: the daemon's (it must outlive the table); null: one of its own, without quotas.
  SequenceTable(LeasePolicy leases, int64_t max_sequences, TenantLedger* ledger = nullptr);
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
  // A fork of `src` (ModelCache::Fork) with a lease of lease_ms (already granted), counted
  // against max_sequences and its tenant's quotas as Open counts a new sequence (its pages
  // against max_pinned_pages); RESOURCE_EXHAUSTED naming the quota and nothing kept
  // otherwise: the quotas are checked before any page is taken for the fork.
  // NOT_FOUND / FAILED_PRECONDITION as ModelCache::Fork.
  absl::StatusOr<std::shared_ptr<Sequence>> Fork(Sequence& src, int64_t lease_ms);
  // NOT_FOUND unless open; refreshes the lease of a found sequence.
  absl::StatusOr<std::shared_ptr<Sequence>> Find(uint64_t id);
  // Sequence `id`, the i-th a request names: found[i] when the check before routing
  // already found it (its lease refreshed as Find does), else Find(id).
  absl::StatusOr<std::shared_ptr<Sequence>> Use(uint64_t id, const FoundSequences& found, size_t i);
  // An open sequence without touching its lease (the authorizer's look-up, whose finds are
  // handed on); NOT_FOUND with Find's message otherwise.
  absl::StatusOr<std::shared_ptr<Sequence>> Peek(uint64_t id) const;
  // Removes and closes it; its length before closing.
  absl::StatusOr<int64_t> Close(uint64_t id);
  // Sets a new lease (0 keeps the current one, capped by GrantLease) and refreshes it;
  // the lease in force.
  absl::StatusOr<int64_t> Renew(uint64_t id, int64_t lease_ms);
  absl::StatusOr<int64_t> Renew(Sequence& seq, int64_t lease_ms);
  // Before a call that may grow `seq` by `tokens` tokens: RESOURCE_EXHAUSTED naming
  // max_pinned_pages if its tenant would hold more than the quota (nothing reserved),
  // else reserves the pages. Settle() then records the pages it really holds.
  absl::Status ReserveTokens(Sequence& seq, int64_t tokens);
  void Settle(Sequence& seq);
  // Closes the sequences whose lease ran out before now_ns; how many.
  int Expire(int64_t now_ns);
  int64_t size() const;

 private:
  absl::StatusOr<std::shared_ptr<Sequence>> Get(uint64_t id) const;
  // Takes a place for a new sequence of `salt` (max_sequences, the tenant's quota) and
  // picks its id; Admit or Refuse ends it.
  absl::StatusOr<uint64_t> Reserve(const std::string& salt);
  // The reserved sequence, now created: counts its pages (max_pinned_pages) and lists it,
  // or closes it and frees the place when they do not fit.
  absl::Status Admit(const std::shared_ptr<Sequence>& seq, int64_t lease_ms);
  void Refuse(const std::string& salt);
  static void Touch(Sequence* seq);

  // Gives a closed sequence's share back to its tenant. REQUIRES: mu_ held.
  void ReleaseLocked(const Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LeasePolicy leases_;
  const int64_t max_sequences_;
  std::unique_ptr<TenantLedger> own_ledger_;
  TenantLedger* const ledger_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  int64_t opening_ ABSL_GUARDED_BY(mu_) = 0;  // Open calls between their check and insert
  std::unordered_map<uint64_t, int64_t> pages_ ABSL_GUARDED_BY(mu_);  // per sequence
};

}  // namespace kvcd
