#include "bench/replay/latency_log.h"

#include <algorithm>
#include <cmath>

namespace kvcd::replay {

const char* CallName(Call c) {
  switch (c) {
    case Call::kMatch:
      return "Match";
    case Call::kPut:
      return "Put";
    case Call::kOpen:
      return "OpenSequence";
    case Call::kAppend:
      return "Append";
    case Call::kClose:
      return "CloseSequence";
    case Call::kCount:
      break;
  }
  return "?";
}

double LatencyLog::Percentile(Call c, double q) const {
  std::vector<double> v = samples_[static_cast<size_t>(c)];
  if (v.empty()) return 0;
  const double rank = std::ceil(q * static_cast<double>(v.size()));
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(v.size()))) - 1;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(i), v.end());
  return v[i];
}

double LatencyLog::Mean(Call c) const {
  const auto& v = samples_[static_cast<size_t>(c)];
  if (v.empty()) return 0;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

}  // namespace kvcd::replay
