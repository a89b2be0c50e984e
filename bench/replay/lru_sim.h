// LruSim: a simulation of a prefix cache of pages with least-recently-used eviction, fed the
// same calls as the daemon (Match, Put, OpenSequence, Append, CloseSequence with or without
// commit), at the daemon's capacity in pages. It is written from the policy the daemon
// states, not from its code, so that the replay can check that the daemon does what its
// policy says:
// - a page is keyed by its prefix (a trace block id names a whole prefix); the cache holds a
//   page only with its parent, so only leaves are evicted;
// - every call that looks a prefix up stamps its pages with a fresh clock (Put and a commit
//   stamp the whole prefix they insert); eviction takes the leaf with the oldest stamp (ties:
//   the deepest first), one page at a time;
// - pages of an open sequence's prefix (and, during a Put, of the prefix being put) are
//   pinned; a sequence's own pages (what it appended) take pool pages until it closes;
// - a call that needs pages evicts exactly as many as it lacks; after a Put, a pool fuller
//   than high_watermark of its pages is brought down to low_watermark (high 1: never);
// - a commit inserts the sequence's full own pages (a page already cached is deduplicated
//   and the sequence's copy freed) and frees the partial one.
#pragma once

#include <cstdint>
#include <limits>
#include <set>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"

namespace kvcd::replay {

class LruSim {
 public:
  struct Options {
    int64_t capacity_pages = std::numeric_limits<int64_t>::max();  // max: never evicts
    double high_watermark = 1.0;
    double low_watermark = 1.0;
  };
  struct Counters {
    int64_t evicted_pages = 0;
    int64_t evicted_committed_pages = 0;
    int64_t inserted_pages = 0;   // by Put
    int64_t committed_pages = 0;  // inserted by commits
    int64_t deduplicated_pages = 0;
  };
  struct MatchResult {
    int64_t pages = 0;            // the longest cached prefix
    int64_t committed_pages = 0;  // of which entered by a commit
  };

  explicit LruSim(Options o) : o_(o) {}

  // The longest cached prefix of `keys` (stamped).
  MatchResult Match(absl::Span<const int64_t> keys);
  // Inserts the missing pages of `keys` (stamped). RESOURCE_EXHAUSTED, changing nothing, when
  // they do not fit even after evicting every unpinned page.
  absl::Status Put(absl::Span<const int64_t> keys);
  // Opens the one sequence on the longest cached prefix of `keys` (stamped, pinned); returns
  // its pages. REQUIRES: no sequence open.
  int64_t Open(absl::Span<const int64_t> keys);
  // The open sequence takes `pages` own pages (evicting as needed). RESOURCE_EXHAUSTED,
  // changing nothing, when they do not fit.
  absl::Status Append(int64_t pages);
  // Closes the open sequence, freeing its own pages. With commit, `commit_keys` (the keys of
  // its full own pages, in order, following the prefix it was opened on) are inserted first.
  // Put and Close: FAILED_PRECONDITION, inserting nothing, when a key to insert is cached after
  // another prefix (keys that are not a prefix chain).
  absl::Status Close(bool commit, absl::Span<const int64_t> commit_keys);

  int64_t used_pages() const { return static_cast<int64_t>(nodes_.size()) + own_pages_; }
  int64_t cached_pages() const { return static_cast<int64_t>(nodes_.size()); }
  bool Contains(int64_t key) const { return nodes_.contains(key); }
  const Counters& counters() const { return counters_; }
  const Options& options() const { return o_; }

 private:
  static constexpr int64_t kRoot = std::numeric_limits<int64_t>::min();
  struct Node {
    int64_t parent = kRoot;
    int64_t depth = 0;
    int64_t children = 0;
    int64_t pins = 0;
    uint64_t stamp = 0;
    bool committed = false;
  };
  // Evictable leaves by (stamp, -depth, key): the first is the next to go.
  using LeafKey = std::tuple<uint64_t, int64_t, int64_t>;

  // The longest prefix of `keys` cached as a chain (each key after the one before it).
  int64_t Cached(absl::Span<const int64_t> keys) const;
  absl::Status CheckChain(absl::Span<const int64_t> keys, int64_t cached) const;
  void Stamp(absl::Span<const int64_t> keys, uint64_t now);
  void Pin(absl::Span<const int64_t> keys);
  void Unpin(absl::Span<const int64_t> keys);
  // Inserts keys[i] for every i at or past the cached prefix (stamped `now`); counts them.
  int64_t Insert(absl::Span<const int64_t> keys, uint64_t now, bool committed);
  int64_t Evictable() const;
  // Evicts least-recently-used leaves while more than `target` pages are used.
  void EvictTo(int64_t target);
  void Leaf(int64_t key, const Node& n, bool add);
  int64_t Free() const;

  Options o_;
  Counters counters_;
  uint64_t clock_ = 0;
  int64_t own_pages_ = 0;
  int64_t pinned_pages_ = 0;
  std::vector<int64_t> open_;  // the open sequence's pinned prefix
  bool is_open_ = false;
  absl::flat_hash_map<int64_t, Node> nodes_;
  std::set<LeafKey> leaves_;
};

}  // namespace kvcd::replay
