#include "server/cache/page_owners.h"

namespace kvcd {

PageOwners::PageOwners(absl::Span<const int32_t> pages_per_store)
    : num_stores_(pages_per_store.size()) {
  for (int32_t n : pages_per_store) {
    owner_.emplace_back(static_cast<size_t>(n), -1);
    refs_.emplace_back(static_cast<size_t>(n), 0);
  }
}

int32_t PageOwners::SlotFor(const std::string& tenant) {
  auto it = slot_of_.find(tenant);
  if (it != slot_of_.end()) return it->second;
  if (free_slots_.empty()) {
    free_slots_.push_back(static_cast<int32_t>(slots_.size()));
    slots_.emplace_back();
  }
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  slots_[static_cast<size_t>(slot)].name = tenant;
  slots_[static_cast<size_t>(slot)].held.assign(num_stores_, 0);
  slot_of_.emplace(tenant, slot);
  return slot;
}

void PageOwners::Claim(int32_t store, absl::Span<const int32_t> ids, const std::string& tenant) {
  if (ids.empty()) return;
  const int32_t slot = SlotFor(tenant);
  for (int32_t id : ids) {
    owner_[static_cast<size_t>(store)][static_cast<size_t>(id)] = slot;
    refs_[static_cast<size_t>(store)][static_cast<size_t>(id)] = 1;
  }
  Slot& s = slots_[static_cast<size_t>(slot)];
  s.held[static_cast<size_t>(store)] += static_cast<int64_t>(ids.size());
  s.total += static_cast<int64_t>(ids.size());
}

void PageOwners::Share(const PageRef& page) {
  ++refs_[static_cast<size_t>(page.pool)][static_cast<size_t>(page.page)];
}

bool PageOwners::Release(const PageRef& page) {
  int32_t& refs = refs_[static_cast<size_t>(page.pool)][static_cast<size_t>(page.page)];
  if (refs > 1) {  // another holder (a fork, or the tree) keeps it
    --refs;
    return false;
  }
  refs = 0;
  int32_t& owner = owner_[static_cast<size_t>(page.pool)][static_cast<size_t>(page.page)];
  if (owner >= 0) {
    Slot& s = slots_[static_cast<size_t>(owner)];
    --s.held[static_cast<size_t>(page.pool)];
    if (--s.total == 0) {  // the tenant owns nothing here any more: recycle its slot
      slot_of_.erase(s.name);
      s.name.clear();
      free_slots_.push_back(owner);
    }
    owner = -1;
  }
  return true;
}

int64_t PageOwners::Held(const std::string& tenant, int32_t store) const {
  auto it = slot_of_.find(tenant);
  return it == slot_of_.end() ? 0 : slots_[static_cast<size_t>(it->second)].held[store];
}

std::vector<PageOwners::TenantPages> PageOwners::Tenants() const {
  std::vector<TenantPages> out;
  for (const Slot& s : slots_) {
    if (s.total > 0) out.push_back(TenantPages{s.name, s.held});
  }
  return out;
}

}  // namespace kvcd
