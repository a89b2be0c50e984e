#include "server/engine/prefix_pins.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/random_id.h"

namespace kvcd {

PrefixPins::~PrefixPins() {
  std::map<uint64_t, Entry> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live.swap(pins_);
  }
  for (const auto& [id, e] : live) Release(e);
}

absl::Status PrefixPins::NotLive(uint64_t id) {
  return absl::NotFoundError(
      absl::StrCat("pin ", id, " is not live (never pinned, unpinned, or its ttl ran out)"));
}

void PrefixPins::Release(const Entry& e) {
  e.cache->UnpinPrefix(e.node);
  ledger_->ReleasePrefixPages(e.pin.tenant, e.pin.pages);
}

absl::StatusOr<PrefixPins::Pin> PrefixPins::Add(ModelCache* model, const std::string& tenant,
                                                absl::Span<const int32_t> tokens, int64_t ttl_ms,
                                                int64_t now_ns, int64_t now_unix_ms) {
  const std::string range = absl::StrCat("1..", max_ttl_ms_, " (the daemon's max_pin_ttl_ms)");
  if (ttl_ms < 1 || ttl_ms > max_ttl_ms_) {
    return absl::InvalidArgumentError(absl::StrCat("ttl_ms is ", ttl_ms, ", expected ", range));
  }
  const std::optional<int64_t> ttl_ns = CheckedMul(ttl_ms, 1000000);
  const std::optional<int64_t> deadline = ttl_ns ? CheckedAdd(now_ns, *ttl_ns) : std::nullopt;
  const std::optional<int64_t> expires = CheckedAdd(now_unix_ms, ttl_ms);
  if (!deadline || !expires) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl_ms is ", ttl_ms, ": now + ttl_ms overflows a 64-bit clock; expected ",
                     range, " and a ttl that ends before the year 292277026596"));
  }
  absl::StatusOr<ModelCache::PinnedPrefix> pinned = model->PinPrefix(
      tenant, tokens, [&](int64_t pages) { return ledger_->PinPrefixPages(tenant, pages); });
  if (!pinned.ok()) return pinned.status();
  Entry e;
  e.cache = model;
  e.node = pinned->node;
  e.pin.tenant = tenant;
  e.pin.model = model->spec().name;
  e.pin.tokens = pinned->tokens;
  e.pin.pages = pinned->pages;
  e.pin.deadline_ns = *deadline;
  e.pin.expires_unix_ms = *expires;
  std::lock_guard<std::mutex> lock(mu_);
  do {
    e.pin.id = RandomId64();
  } while (pins_.count(e.pin.id) != 0);
  pins_.emplace(e.pin.id, e);
  return e.pin;
}

absl::StatusOr<int64_t> PrefixPins::Remove(uint64_t id) {
  Entry e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pins_.find(id);
    if (it == pins_.end()) return NotLive(id);
    e = it->second;
    pins_.erase(it);
  }
  Release(e);
  return e.pin.pages;
}

absl::StatusOr<PrefixPins::Pin> PrefixPins::Lookup(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pins_.find(id);
  if (it == pins_.end()) return NotLive(id);
  return it->second.pin;
}

int PrefixPins::Expire(int64_t now_ns) {
  std::vector<Entry> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pins_.begin(); it != pins_.end();) {
      if (it->second.pin.deadline_ns < now_ns) {
        gone.push_back(it->second);
        it = pins_.erase(it);
      } else {
        ++it;
      }
    }
    expired_ += gone.size();
  }
  for (const Entry& e : gone) Release(e);
  return static_cast<int>(gone.size());
}

std::vector<PrefixPins::Pin> PrefixPins::List() const {
  std::vector<Pin> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, e] : pins_) out.push_back(e.pin);
  }
  std::sort(out.begin(), out.end(), [](const Pin& a, const Pin& b) {
    return std::tie(a.tenant, a.expires_unix_ms, a.id) <
           std::tie(b.tenant, b.expires_unix_ms, b.id);
  });
  return out;
}

uint64_t PrefixPins::expired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return expired_;
}

}  // namespace kvcd
