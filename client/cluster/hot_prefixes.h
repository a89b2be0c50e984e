// HotPrefixes: how often one prefix was routed to one holder within a sliding window
// (docs/cluster.md "Routing", step 5), bounded in the pairs it tracks (the least recently
// routed pair is forgotten first). Not thread-safe: the router serializes its use.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace kvcd::cluster {

class HotPrefixes {
 public:
  using Clock = std::function<double()>;  // seconds, monotonic
  HotPrefixes(double window_s, size_t max_tracked, Clock clock = nullptr);

  // Counts one routing of `prefix_hash` (raw bytes) to `holder`; returns the routings in the
  // window, this one included.
  int Record(const std::string& prefix_hash, const std::string& holder);
  // Forgets the pair (after it was replicated: the window starts over).
  void Reset(const std::string& prefix_hash, const std::string& holder);
  size_t tracked() const { return entries_.size(); }

 private:
  using Key = std::pair<std::string, std::string>;
  struct Entry {
    std::deque<double> times;
    std::list<Key>::iterator age;
  };
  double window_s_;
  size_t max_tracked_;
  Clock clock_;
  std::list<Key> order_;  // least recently routed first
  absl::flat_hash_map<Key, Entry> entries_;
};

}  // namespace kvcd::cluster
