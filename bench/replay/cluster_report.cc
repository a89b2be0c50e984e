#include "bench/replay/cluster_report.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "nlohmann/json.hpp"

namespace kvcd::replay {
namespace {

// Nearest-rank q-quantile in milliseconds (0 without samples).
double PercentileMs(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(q * static_cast<double>(v.size()) + 0.999999);
  rank = std::clamp<size_t>(rank, 1, v.size());
  return 1e3 * v[rank - 1];
}

}  // namespace

std::string ClusterFiguresJson(const ClusterFigures& f) {
  using nlohmann::json;
  json members = json::array();
  for (size_t i = 0; i < f.member_ids.size(); ++i) {
    members.push_back({{"member_id", f.member_ids[i]},
                       {"requests", i < f.requests.size() ? f.requests[i] : 0},
                       {"pages_held", i < f.pages_held.size() ? f.pages_held[i] : 0}});
  }
  double max_pages = 0, sum_pages = 0;
  for (int64_t p : f.pages_held) {
    max_pages = std::max(max_pages, static_cast<double>(p));
    sum_pages += static_cast<double>(p);
  }
  const double mean =
      f.pages_held.empty() ? 0 : sum_pages / static_cast<double>(f.pages_held.size());
  json out = {
      {"members", members},
      {"pages_max_over_mean", mean > 0 ? max_pages / mean : 0.0},
      {"lookups", f.lookup_seconds.size()},
      {"lookup_p50_ms", PercentileMs(f.lookup_seconds, 0.5)},
      {"lookup_p99_ms", PercentileMs(f.lookup_seconds, 0.99)},
      {"pulls", f.pulls},
      {"pull_errors", f.pull_errors},
      {"pulled_tokens", f.pulled_tokens},
      {"pulled_bytes", f.pulled_bytes},
      {"pull_p50_ms", PercentileMs(f.pull_seconds, 0.5)},
      {"pull_p99_ms", PercentileMs(f.pull_seconds, 0.99)},
      {"replications", f.replications},
      {"index_errors", f.index_errors},
      {"index_rejected", f.index_rejected},
      {"failovers", f.failovers},
      {"rejoins", f.rejoins},
      {"checked", f.checked},
      {"wrong", f.wrong},
      {"wrong_details", f.wrong_details},
  };
  // One row per request, in order: what the per-window figures of the failure bench read.
  json records = json::array();
  for (const RequestRecord& r : f.records) {
    records.push_back({r.index, std::round(r.seconds * 1e4) / 1e4, r.input_length, r.matched_tokens,
                       r.member, r.unavailable, r.index_error ? 1 : 0, r.checked ? 1 : 0,
                       r.wrong ? 1 : 0});
  }
  out["record_fields"] = {"index",       "seconds",     "input_length", "matched_tokens", "member",
                          "unavailable", "index_error", "checked",      "wrong"};
  out["records"] = records;
  return out.dump(1) + "\n";
}

}  // namespace kvcd::replay
