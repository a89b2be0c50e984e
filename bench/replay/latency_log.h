// Latencies of a replay's RPCs by call kind, and their percentiles.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcd::replay {

enum class Call { kMatch, kPut, kOpen, kAppend, kClose, kCount };
const char* CallName(Call c);

class LatencyLog {
 public:
  void Add(Call c, double seconds) { samples_[static_cast<size_t>(c)].push_back(seconds); }
  int64_t count(Call c) const {
    return static_cast<int64_t>(samples_[static_cast<size_t>(c)].size());
  }
  int64_t total() const {
    int64_t n = 0;
    for (const auto& v : samples_) n += static_cast<int64_t>(v.size());
    return n;
  }
  // The q-quantile (0 < q <= 1) in seconds by the nearest-rank rule: the smallest sample with
  // at least q of the samples at or below it; 0 without samples.
  double Percentile(Call c, double q) const;
  double Mean(Call c) const;

 private:
  std::array<std::vector<double>, static_cast<size_t>(Call::kCount)> samples_;
};

}  // namespace kvcd::replay
