#include "bench/replay/replay.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvcd::replay {

namespace {

double ClientCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// One request through a simulation, with the calls the target gets. A call the pool cannot
// serve fails in the simulation as in the target (the target's error stops the replay); a
// simulation error is only a workload that is not a prefix chain, which TraceWorkload rules out.
absl::StatusOr<LruSim::MatchResult> Simulate(LruSim& sim, const ReplayRequest& r, int32_t page_size,
                                             bool commit) {
  const LruSim::MatchResult m = sim.Match(r.prompt_pages);
  const int64_t full = static_cast<int64_t>(r.prompt_pages.size());
  absl::Status s;
  if (m.pages < full) s = sim.Put(r.prompt_pages);
  if (absl::IsFailedPrecondition(s)) return s;
  const int64_t opened = sim.Open(r.prompt_pages);
  const int64_t len = static_cast<int64_t>(r.prompt.size()) + r.output_tokens;
  sim.Append((len + page_size - 1) / page_size - opened).IgnoreError();
  if (s = sim.Close(commit, r.commit_pages); !s.ok()) return s;
  return m;
}

void Add(CacheFigures* f, const LruSim::MatchResult& m) {
  f->hit_pages += m.pages;
  f->committed_hit_pages += m.committed_pages;
}

}  // namespace

double ReplayReport::HitRate(const CacheFigures& f) const {
  return workload.prompt_tokens == 0 ? 0
                                     : static_cast<double>(f.hit_pages * kTraceBlockTokens) /
                                           static_cast<double>(workload.prompt_tokens);
}

double ReplayReport::CommittedRate(const CacheFigures& f) const {
  return workload.prompt_tokens == 0
             ? 0
             : static_cast<double>(f.committed_hit_pages * kTraceBlockTokens) /
                   static_cast<double>(workload.prompt_tokens);
}

absl::StatusOr<double> ProcessCpuSeconds(int pid) {
  const std::string path = absl::StrCat("/proc/", pid, "/stat");
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  // Fields after the command name (which is in parentheses and may hold spaces).
  const size_t close = text.rfind(')');
  if (!in || close == std::string::npos) {
    return absl::NotFoundError(
        absl::StrCat("cannot read ", path, " (is ", pid, " a local process?)"));
  }
  const std::vector<std::string> f = absl::StrSplit(text.substr(close + 2), ' ');
  // f[0] is field 3 (state); utime and stime are fields 14 and 15.
  if (f.size() < 13) return absl::DataLossError(absl::StrCat(path, ": too few fields"));
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  return (std::stod(f[11]) + std::stod(f[12])) / ticks;
}

absl::StatusOr<ReplayReport> Replay(const TraceWorkload& workload, Target& target,
                                    const v1::ModelProfile& profile, const ReplayOptions& options) {
  ReplayReport rep;
  rep.target = target.Describe();
  rep.page_size = workload.page_size();
  rep.workload = workload.summary();
  if (profile.page_size() != workload.page_size()) {
    return absl::InvalidArgumentError(absl::StrCat("the model's page_size ", profile.page_size(),
                                                   " is not the workload's ",
                                                   workload.page_size()));
  }
  auto capacity = target.Prepare(profile);
  if (!capacity.ok()) return capacity.status();
  rep.capacity_pages = *capacity;
  LruSim lru({.capacity_pages = *capacity,
              .high_watermark = options.high_watermark,
              .low_watermark = options.low_watermark});
  LruSim infinite({}), infinite_commit({});
  auto before = target.Stats();
  if (!before.ok()) return before.status();
  rep.stats_before = *before;
  double daemon_cpu0 = 0;
  if (options.daemon_pid > 0) {
    auto cpu = ProcessCpuSeconds(options.daemon_pid);
    if (!cpu.ok()) return cpu.status();
    daemon_cpu0 = *cpu;
  }
  const double client_cpu0 = ClientCpuSeconds();
  const auto t0 = std::chrono::steady_clock::now();
  const int32_t ps = workload.page_size();
  for (int64_t i = 0; i < workload.size(); ++i) {
    const ReplayRequest& r = workload.request(i);
    if (options.before_request) {
      if (absl::Status s = options.before_request(i); !s.ok()) return s;
    }
    const int64_t calls_before = rep.latency.total();
    auto out = target.Serve(r, options.commit, &rep.latency);
    if (!out.ok()) return out.status();
    rep.rpcs += rep.latency.total() - calls_before;
    ++rep.requests;
    rep.commits_served += out->commit_served ? 1 : 0;
    rep.checked_requests += out->checked ? 1 : 0;
    rep.wrong_requests += out->wrong ? 1 : 0;
    rep.daemon.hit_pages += out->matched_tokens / ps;
    rep.daemon.committed_hit_pages += out->committed_tokens / ps;
    auto m = Simulate(lru, r, ps, out->commit_served);
    auto inf = Simulate(infinite, r, ps, /*commit=*/false);
    auto inf_commit = Simulate(infinite_commit, r, ps, options.commit);
    for (const auto* s : {&m, &inf, &inf_commit}) {
      if (!s->ok())
        return absl::InternalError(absl::StrCat("request ", i, ": ", s->status().message()));
    }
    Add(&rep.lru, *m);
    if (m->pages * ps != out->matched_tokens) ++rep.lru_mismatched_requests;
    Add(&rep.infinite, *inf);
    Add(&rep.infinite_commit, *inf_commit);
    if (options.progress) options.progress(i + 1, rep.HitRate(rep.daemon));
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rep.client_cpu_seconds = ClientCpuSeconds() - client_cpu0;
  if (options.daemon_pid > 0) {
    auto cpu = ProcessCpuSeconds(options.daemon_pid);
    if (!cpu.ok()) return cpu.status();
    rep.daemon_cpu_seconds = *cpu - daemon_cpu0;
  }
  rep.lru_counters = lru.counters();
  auto after = target.Stats();
  if (!after.ok()) return after.status();
  rep.stats_after = *after;
  return rep;
}

}  // namespace kvcd::replay
