#include "bench/replay/lru_sim.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvcd::replay {

void LruSim::Leaf(int64_t key, const Node& n, bool add) {
  const LeafKey k{n.stamp, -n.depth, key};
  if (add) {
    if (n.children == 0 && n.pins == 0) leaves_.insert(k);
  } else {
    leaves_.erase(k);
  }
}

int64_t LruSim::Cached(absl::Span<const int64_t> keys) const {
  size_t k = 0;
  for (; k < keys.size(); ++k) {
    auto it = nodes_.find(keys[k]);
    if (it == nodes_.end() || it->second.parent != (k == 0 ? kRoot : keys[k - 1])) break;
  }
  return static_cast<int64_t>(k);
}

void LruSim::Stamp(absl::Span<const int64_t> keys, uint64_t now) {
  for (int64_t key : keys) {
    Node& n = nodes_.at(key);
    Leaf(key, n, false);
    n.stamp = now;
    Leaf(key, n, true);
  }
}

void LruSim::Pin(absl::Span<const int64_t> keys) {
  for (int64_t key : keys) {
    Node& n = nodes_.at(key);
    Leaf(key, n, false);
    if (n.pins++ == 0) ++pinned_pages_;
  }
}

void LruSim::Unpin(absl::Span<const int64_t> keys) {
  for (int64_t key : keys) {
    Node& n = nodes_.at(key);
    if (--n.pins == 0) --pinned_pages_;
    Leaf(key, n, true);
  }
}

int64_t LruSim::Free() const {
  return o_.capacity_pages == std::numeric_limits<int64_t>::max()
             ? std::numeric_limits<int64_t>::max()
             : o_.capacity_pages - used_pages();
}

int64_t LruSim::Evictable() const { return cached_pages() - pinned_pages_; }

void LruSim::EvictTo(int64_t target) {
  while (used_pages() > target && !leaves_.empty()) {
    const auto [stamp, depth, key] = *leaves_.begin();
    leaves_.erase(leaves_.begin());
    auto it = nodes_.find(key);
    const Node n = it->second;
    nodes_.erase(it);
    ++counters_.evicted_pages;
    if (n.committed) ++counters_.evicted_committed_pages;
    if (n.parent != kRoot) {
      Node& p = nodes_.at(n.parent);
      --p.children;
      Leaf(n.parent, p, true);
    }
  }
}

int64_t LruSim::Insert(absl::Span<const int64_t> keys, uint64_t now, bool committed) {
  const int64_t cached = Cached(keys);
  Stamp(keys.subspan(0, static_cast<size_t>(cached)), now);
  for (size_t i = static_cast<size_t>(cached); i < keys.size(); ++i) {
    Node n;
    n.parent = i == 0 ? kRoot : keys[i - 1];
    n.depth = static_cast<int64_t>(i);
    n.stamp = now;
    n.committed = committed;
    if (n.parent != kRoot) {
      Node& p = nodes_.at(n.parent);
      Leaf(n.parent, p, false);
      ++p.children;
    }
    nodes_.emplace(keys[i], n);
    Leaf(keys[i], n, true);
  }
  return static_cast<int64_t>(keys.size()) - cached;
}

LruSim::MatchResult LruSim::Match(absl::Span<const int64_t> keys) {
  MatchResult r;
  r.pages = Cached(keys);
  const auto path = keys.subspan(0, static_cast<size_t>(r.pages));
  for (int64_t key : path) r.committed_pages += nodes_.at(key).committed ? 1 : 0;
  Stamp(path, ++clock_);
  return r;
}

absl::Status LruSim::CheckChain(absl::Span<const int64_t> keys, int64_t cached) const {
  for (size_t i = static_cast<size_t>(cached); i < keys.size(); ++i) {
    if (nodes_.contains(keys[i])) {
      return absl::FailedPreconditionError(absl::StrCat(
          "key ", keys[i], " is cached after another prefix: the keys are not a prefix chain"));
    }
  }
  return absl::OkStatus();
}

absl::Status LruSim::Put(absl::Span<const int64_t> keys) {
  const int64_t cached = Cached(keys);
  if (absl::Status s = CheckChain(keys, cached); !s.ok()) return s;
  const auto path = keys.subspan(0, static_cast<size_t>(cached));
  Stamp(path, ++clock_);
  Pin(path);
  const int64_t need = static_cast<int64_t>(keys.size()) - cached;
  if (need > Free() && need > Free() + Evictable()) {
    Unpin(path);
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", need, " pages, ", Free(), " free and ", Evictable(), " evictable"));
  }
  if (need > Free()) EvictTo(o_.capacity_pages - need);
  counters_.inserted_pages += Insert(keys, ++clock_, /*committed=*/false);
  // Under the watermarks, with the whole put prefix pinned.
  Pin(keys.subspan(static_cast<size_t>(cached)));
  if (o_.capacity_pages != std::numeric_limits<int64_t>::max() &&
      static_cast<double>(used_pages()) >
          o_.high_watermark * static_cast<double>(o_.capacity_pages)) {
    // The daemon evicts while used > low * total (a double): to the largest integer at or below.
    EvictTo(static_cast<int64_t>(
        std::floor(o_.low_watermark * static_cast<double>(o_.capacity_pages))));
  }
  Unpin(keys);
  return absl::OkStatus();
}

int64_t LruSim::Open(absl::Span<const int64_t> keys) {
  const int64_t cached = Cached(keys);
  open_.assign(keys.begin(), keys.begin() + cached);
  Stamp(open_, ++clock_);
  Pin(open_);
  is_open_ = true;
  return cached;
}

absl::Status LruSim::Append(int64_t pages) {
  if (pages > Free() && pages > Free() + Evictable()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", pages, " pages, ", Free(), " free and ", Evictable(), " evictable"));
  }
  if (pages > Free()) EvictTo(o_.capacity_pages - pages);
  own_pages_ += pages;
  return absl::OkStatus();
}

absl::Status LruSim::Close(bool commit, absl::Span<const int64_t> commit_keys) {
  if (!is_open_) return absl::FailedPreconditionError("no sequence is open");
  std::vector<int64_t> all = open_;
  all.insert(all.end(), commit_keys.begin(), commit_keys.end());
  absl::Status status;
  if (commit) status = CheckChain(all, Cached(all));
  if (commit && status.ok() && !commit_keys.empty()) {
    const int64_t before = static_cast<int64_t>(nodes_.size());
    // The sequence's own pages become tree pages (or are freed as duplicates).
    const int64_t inserted = Insert(all, ++clock_, /*committed=*/true);
    counters_.committed_pages += static_cast<int64_t>(nodes_.size()) - before;
    counters_.deduplicated_pages += static_cast<int64_t>(commit_keys.size()) - inserted;
  }
  own_pages_ = 0;
  Unpin(open_);
  open_.clear();
  is_open_ = false;
  return status;
}

}  // namespace kvcd::replay
