#include "bench/replay/report.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace kvcd::replay {

namespace {

constexpr Call kCalls[] = {Call::kMatch, Call::kPut, Call::kOpen, Call::kAppend, Call::kClose};

int64_t Evicted(const ReplayReport& r) {
  return r.stats_after.evicted_pages - r.stats_before.evicted_pages;
}
int64_t EvictedCommitted(const ReplayReport& r) {
  return r.stats_after.evicted_pages_committed - r.stats_before.evicted_pages_committed;
}
double Rate(const ReplayReport& r) { return r.seconds > 0 ? r.requests / r.seconds : 0; }

}  // namespace

std::string ReportText(const ReplayReport& r, const std::string& trace_name) {
  std::string s;
  const WorkloadSummary& w = r.workload;
  absl::StrAppendFormat(&s, "kvcd-replay: %d requests of %s against %s\n", r.requests, trace_name,
                        r.target);
  absl::StrAppendFormat(
      &s,
      "scale: one 512-token trace block = one page of %d tokens; capacity %d pages (%d trace "
      "tokens)\n",
      r.page_size, r.capacity_pages, r.capacity_pages * kTraceBlockTokens);
  absl::StrAppendFormat(&s,
                        "trace: %d prompt tokens, %d output tokens, %d full blocks (%d distinct); "
                        "%d requests continued by a later one\n\n",
                        w.prompt_tokens, w.output_tokens, w.full_blocks, w.distinct_blocks,
                        w.continued);
  absl::StrAppendFormat(&s, "%-24s %9s %11s %18s\n", "prompt tokens from cache", "hit rate",
                        "committed", "prefill avoided");
  auto row = [&](const char* name, const CacheFigures& f) {
    absl::StrAppendFormat(&s, "%-24s %8.2f%% %10.2f%% %18d\n", name, 100 * r.HitRate(f),
                          100 * r.CommittedRate(f), f.hit_pages * kTraceBlockTokens);
  };
  row("daemon", r.daemon);
  row("LRU simulation", r.lru);
  row("infinite cache", r.infinite);
  row("infinite, commits", r.infinite_commit);
  absl::StrAppendFormat(&s,
                        "\ndaemon - LRU simulation: %+.3f points; %d of %d requests matched a "
                        "different prefix\n",
                        100 * (r.HitRate(r.daemon) - r.HitRate(r.lru)), r.lru_mismatched_requests,
                        r.requests);
  absl::StrAppendFormat(&s, "evictions: daemon %d pages (%d committed), LRU simulation %d (%d)\n",
                        Evicted(r), EvictedCommitted(r), r.lru_counters.evicted_pages,
                        r.lru_counters.evicted_committed_pages);
  absl::StrAppendFormat(
      &s, "commits: %d of %d sequences committed%s\n", r.commits_served, r.requests,
      r.commits_served == 0 ? " (the target did not commit: outputs not reused)" : "");
  if (r.checked_requests > 0) {
    absl::StrAppendFormat(&s, "answers checked: %d requests, %d wrong\n", r.checked_requests,
                          r.wrong_requests);
  }
  absl::StrAppendFormat(&s,
                        "throughput: %.1f requests/s (%d requests in %.1f s); %d RPCs, all OK\n",
                        Rate(r), r.requests, r.seconds, r.rpcs);
  if (r.daemon_cpu_seconds >= 0) {
    absl::StrAppendFormat(
        &s, "daemon CPU: %.1f s = %.2f cores busy (of %d); replay client %.1f s\n",
        r.daemon_cpu_seconds, r.seconds > 0 ? r.daemon_cpu_seconds / r.seconds : 0,
        std::thread::hardware_concurrency(), r.client_cpu_seconds);
  }
  absl::StrAppendFormat(&s, "\n%-14s %7s %9s %9s %9s\n", "latency (ms)", "calls", "p50", "p90",
                        "p99");
  for (Call c : kCalls) {
    absl::StrAppendFormat(&s, "%-14s %7d %9.3f %9.3f %9.3f\n", CallName(c), r.latency.count(c),
                          1e3 * r.latency.Percentile(c, 0.5), 1e3 * r.latency.Percentile(c, 0.9),
                          1e3 * r.latency.Percentile(c, 0.99));
  }
  return s;
}

std::string ReportJson(const ReplayReport& r, const std::string& trace_name) {
  using nlohmann::json;
  auto figures = [&](const CacheFigures& f) {
    return json{{"hit_rate", r.HitRate(f)},
                {"committed_hit_rate", r.CommittedRate(f)},
                {"hit_pages", f.hit_pages},
                {"committed_hit_pages", f.committed_hit_pages},
                {"prefill_tokens_avoided", f.hit_pages * kTraceBlockTokens}};
  };
  json latency = json::object();
  for (Call c : kCalls) {
    latency[CallName(c)] = {{"calls", r.latency.count(c)},
                            {"p50_ms", 1e3 * r.latency.Percentile(c, 0.5)},
                            {"p90_ms", 1e3 * r.latency.Percentile(c, 0.9)},
                            {"p99_ms", 1e3 * r.latency.Percentile(c, 0.99)},
                            {"mean_ms", 1e3 * r.latency.Mean(c)}};
  }
  const WorkloadSummary& w = r.workload;
  json j = {
      {"trace", trace_name},
      {"target", r.target},
      {"page_size", r.page_size},
      {"capacity_pages", r.capacity_pages},
      {"capacity_trace_tokens", r.capacity_pages * kTraceBlockTokens},
      {"workload",
       {{"requests", w.requests},
        {"prompt_tokens", w.prompt_tokens},
        {"output_tokens", w.output_tokens},
        {"full_blocks", w.full_blocks},
        {"distinct_blocks", w.distinct_blocks},
        {"continued_requests", w.continued},
        {"commit_pages", w.commit_pages},
        {"commit_pages_continued", w.commit_pages_continued}}},
      {"requests", r.requests},
      {"rpcs", r.rpcs},
      {"commits_served", r.commits_served},
      {"daemon", figures(r.daemon)},
      {"lru_simulation", figures(r.lru)},
      {"infinite", figures(r.infinite)},
      {"infinite_with_commits", figures(r.infinite_commit)},
      {"lru_mismatched_requests", r.lru_mismatched_requests},
      {"checked_requests", r.checked_requests},
      {"wrong_requests", r.wrong_requests},
      {"evicted_pages", Evicted(r)},
      {"evicted_pages_committed", EvictedCommitted(r)},
      {"lru_evicted_pages", r.lru_counters.evicted_pages},
      {"lru_evicted_pages_committed", r.lru_counters.evicted_committed_pages},
      {"seconds", r.seconds},
      {"requests_per_second", Rate(r)},
      {"client_cpu_seconds", r.client_cpu_seconds},
      {"latency", latency},
  };
  if (r.daemon_cpu_seconds >= 0) {
    j["daemon_cpu_seconds"] = r.daemon_cpu_seconds;
    j["daemon_cores_busy"] = r.seconds > 0 ? r.daemon_cpu_seconds / r.seconds : 0;
  }
  return j.dump(2) + "\n";
}

}  // namespace kvcd::replay
