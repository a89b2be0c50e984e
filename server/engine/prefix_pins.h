// PrefixPins: the daemon's live prefix pins (PinPrefix / UnpinPrefix, docs/sessions.md
// "Pinned prefixes"). A pin holds the longest cached page-aligned prefix of a token list
// pinned in its model's radix tree (ModelCache::PinPrefix), so that eviction skips those
// pages until the pin is removed or its ttl runs out; then they are ordinary LRU pages
// again. Ids are random 64-bit values (common/random_id.h), never reused across restarts.
// A pin's tenant is the request's cache_salt; its pages count against the tenant's
// max_pinned_prefix_pages in the TenantLedger, per pin. Pins live in memory only: a
// restarted daemon has none.
//
// Thread safety: all methods are thread-safe. Lock order: the table's lock is never held
// while a model cache or the ledger is called.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/cache/model_cache.h"
#include "server/engine/tenant_ledger.h"

namespace kvcd {

class PrefixPins {
 public:
  struct Pin {
    uint64_t id = 0;
    std::string tenant;  // the cache_salt it was pinned under
    std::string model;
    int64_t tokens = 0;
    int64_t pages = 0;
    int64_t deadline_ns = 0;  // steady clock: expired once the sweep's now passes it
    int64_t expires_unix_ms = 0;
  };

  // ledger: the daemon's (it must outlive the table). max_ttl_ms: the config's
  // max_pin_ttl_ms.
  PrefixPins(TenantLedger* ledger, int64_t max_ttl_ms) : ledger_(ledger), max_ttl_ms_(max_ttl_ms) {}
  // Releases every pin still live (their trees must still exist).
  ~PrefixPins();
  PrefixPins(const PrefixPins&) = delete;
  PrefixPins& operator=(const PrefixPins&) = delete;

  // Pins the cached prefix of `tokens` in `model` for ttl_ms from now (now_ns: steady clock;
  // now_unix_ms: wall clock, for expires_unix_ms). INVALID_ARGUMENT naming ttl_ms and the
  // allowed range when ttl_ms is not in 1..max_ttl_ms or overflows int64 when added to now;
  // NOT_FOUND when no page is cached; RESOURCE_EXHAUSTED naming max_pinned_prefix_pages.
  // Nothing is pinned or counted on an error.
  absl::StatusOr<Pin> Add(ModelCache* model, const std::string& tenant,
                          absl::Span<const int32_t> tokens, int64_t ttl_ms, int64_t now_ns,
                          int64_t now_unix_ms);
  // Removes pin `id`; the pages it pinned. NOT_FOUND with Lookup's message when it is not live.
  absl::StatusOr<int64_t> Remove(uint64_t id);
  // Pin `id` if it is live; NOT_FOUND ("pin <id> is not live (never pinned, unpinned, or its
  // ttl ran out)") otherwise.
  absl::StatusOr<Pin> Lookup(uint64_t id) const;
  // Removes the pins whose deadline is before now_ns; how many.
  int Expire(int64_t now_ns);
  // Every live pin, by tenant, then expiry, then id.
  std::vector<Pin> List() const;
  uint64_t expired() const;

  static absl::Status NotLive(uint64_t id);

 private:
  struct Entry {
    Pin pin;
    ModelCache* cache = nullptr;
    RadixTree::Node* node = nullptr;
  };
  void Release(const Entry& e);

  TenantLedger* const ledger_;
  const int64_t max_ttl_ms_;
  mutable std::mutex mu_;
  std::map<uint64_t, Entry> pins_ ABSL_GUARDED_BY(mu_);
  uint64_t expired_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcd
