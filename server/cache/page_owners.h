// PageOwners: who holds each page of a model's stores. Every page in use has one owning
// tenant (the cache_salt whose call created it, counted against its memory share) and a
// number of holders (1 for the tree or the one sequence holding it; more while forks share
// a sequence's page). ModelCache asks it what a tenant holds per store and tells it when
// pages are claimed, shared and released; the pools themselves stay ModelCache's.
//
// Not thread-safe: ModelCache calls it under its own lock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "server/cache/radix_tree.h"

namespace kvcd {

class PageOwners {
 public:
  // One store per entry of pages_per_store (its page count); every page starts free.
  explicit PageOwners(absl::Span<const int32_t> pages_per_store);

  // Pages `ids` of store `store`, free until now, are `tenant`'s with one holder each.
  void Claim(int32_t store, absl::Span<const int32_t> ids, const std::string& tenant);
  // One more holder of a page in use.
  void Share(const PageRef& page);
  // One holder lets `page` go. True when it was the last one: the page is free again (its
  // owner's counts drop) and the caller returns it to its pool.
  bool Release(const PageRef& page);

  // Holders of a page (0: free).
  int32_t holders(const PageRef& page) const {
    return refs_[static_cast<size_t>(page.pool)][static_cast<size_t>(page.page)];
  }
  // Pages of store `store` that `tenant` owns.
  int64_t Held(const std::string& tenant, int32_t store) const;

  struct TenantPages {
    std::string tenant;
    std::vector<int64_t> pages;  // per store
  };
  // Every tenant owning pages, in no particular order.
  std::vector<TenantPages> Tenants() const;

 private:
  // A slot is recycled once its tenant owns no page, so the slots stay bounded by the pages.
  struct Slot {
    std::string name;
    std::vector<int64_t> held;  // per store
    int64_t total = 0;
  };
  int32_t SlotFor(const std::string& tenant);

  size_t num_stores_;
  std::vector<std::vector<int32_t>> owner_;  // [store][page]: a slot of slots_, -1 free
  std::vector<std::vector<int32_t>> refs_;   // [store][page]: holders, 0 free
  std::vector<Slot> slots_;
  std::vector<int32_t> free_slots_;
  absl::flat_hash_map<std::string, int32_t> slot_of_;
};

}  // namespace kvcd
