#include "client/cluster/hot_prefixes.h"

#include <chrono>

namespace kvcd::cluster {

HotPrefixes::HotPrefixes(double window_s, size_t max_tracked, Clock clock)
    : window_s_(window_s),
      max_tracked_(max_tracked < 1 ? 1 : max_tracked),
      clock_(std::move(clock)) {
  if (!clock_) {
    clock_ = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
    };
  }
}

int HotPrefixes::Record(const std::string& prefix_hash, const std::string& holder) {
  const double now = clock_();
  Key key(prefix_hash, holder);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    order_.push_back(key);
    it = entries_.emplace(key, Entry{{}, std::prev(order_.end())}).first;
  } else {
    order_.splice(order_.end(), order_, it->second.age);
  }
  std::deque<double>& t = it->second.times;
  t.push_back(now);
  while (!t.empty() && t.front() <= now - window_s_) t.pop_front();
  const int count = static_cast<int>(t.size());
  while (entries_.size() > max_tracked_) {
    entries_.erase(order_.front());
    order_.pop_front();
  }
  return count;
}

void HotPrefixes::Reset(const std::string& prefix_hash, const std::string& holder) {
  auto it = entries_.find(Key(prefix_hash, holder));
  if (it == entries_.end()) return;
  order_.erase(it->second.age);
  entries_.erase(it);
}

}  // namespace kvcd::cluster
