// kvcd-replay: replays a Mooncake-format request trace against a kvcd daemon and reports the
// prefix-cache hit rate beside an LRU simulation at the same capacity and the trace's
// infinite-cache bound (docs/performance.md "Replaying a trace"; bench/replay/ holds the parts).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/replay/cluster_report.h"
#include "bench/replay/cluster_target.h"
#include "bench/replay/daemon_target.h"
#include "bench/replay/progress_bar.h"
#include "bench/replay/replay.h"
#include "bench/replay/report.h"
#include "bench/replay/trace.h"
#include "bench/replay/workload.h"
#include "common/cli.h"

ABSL_FLAG(std::string, trace, "", "Mooncake-format JSONL trace to replay (required)");
ABSL_FLAG(int64_t, requests, 0, "replay only the first N requests (0 = all)");
ABSL_FLAG(std::string, target, "127.0.0.1:50051", "daemon address HOST:PORT");
ABSL_FLAG(std::string, model, "replay-tiny", "name under which the replay registers its model");
ABSL_FLAG(int32_t, page_size, 16, "tokens of the page that stands for one 512-token trace block");
ABSL_FLAG(int32_t, layers, 2, "layers of the replay model");
ABSL_FLAG(int32_t, kv_heads, 2, "KV heads of the replay model");
ABSL_FLAG(int32_t, head_dim, 32, "head_dim of the replay model (8, 16, 32, 64, 128 or 256)");
ABSL_FLAG(int64_t, capacity_pages, 1953,
          "pages of the model's pool (one page = one trace block: 1953 = 1M trace tokens)");
ABSL_FLAG(bool, commit, true, "commit every sequence on close (CloseSequenceRequest.commit)");
ABSL_FLAG(double, high_watermark, 0.95,
          "the daemon's high_watermark (its config), for the simulation");
ABSL_FLAG(double, low_watermark, 0.85,
          "the daemon's low_watermark (its config), for the simulation");
ABSL_FLAG(int32_t, daemon_pid, 0, "pid of the daemon when it runs on this machine: report its CPU");
ABSL_FLAG(bool, json, false, "print the report as JSON instead of text");
ABSL_FLAG(bool, progress, true, "progress bar on stderr");
ABSL_FLAG(int64_t, deadline_ms, 60000, "deadline of each RPC");
ABSL_FLAG(std::string, members, "",
          "cluster target: comma-separated HOST:PORT of the members (their member id and "
          "incarnation come from their Stats); replaces --target");
ABSL_FLAG(std::string, routing, "index", "cluster routing: random, rendezvous or index");
ABSL_FLAG(std::string, redis_url, "", "cluster index (routing index): redis://HOST:PORT[/DB]");
ABSL_FLAG(std::string, cluster_name, "", "cluster name of the members (routing index)");
ABSL_FLAG(bool, pull, true, "routing index: a member chosen over a longer holder pulls first");
ABSL_FLAG(
    int32_t, replicate_after, 8,
    "routing index: routings of a prefix to a loaded holder before it is replicated (0: off)");
ABSL_FLAG(uint64_t, seed, 1, "routing random: the seed");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "cluster target: comma-separated HOST:PORT of etcd: follow membership (a member "
          "whose key is gone leaves routing, one back under a new incarnation rejoins it)");
ABSL_FLAG(int64_t, verify_every, 0,
          "check every N-th request's attention over its whole sequence against a float64 "
          "reference of the rows the replay sent (0: none); mismatches are counted as wrong");
ABSL_FLAG(std::string, hook, "",
          "a shell command run before the requests at --hook-at, with two arguments: the "
          "hook's number (0, 1, ...) and the request's position; a failing hook stops the replay");
ABSL_FLAG(std::string, hook_at, "", "comma-separated request positions (0-based) of --hook");
ABSL_FLAG(std::string, cluster_json, "",
          "cluster target: write its figures (per-member "
          "requests and pages, lookups, pulls) to this file");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd-replay",
      .summary = "replays a Mooncake-format request trace against a kvcd daemon",
      .files = {__FILE__},
      .synopsis = R"(--trace FILE.jsonl [--target HOST:PORT] [--capacity-pages N] [--requests N]
    [--daemon-pid PID] [--high-watermark H --low-watermark L] [--json])",
      .notes = R"(Per request: Match, Put of the prompt's missing pages, OpenSequence, Append of the
partial tail and the output tokens, CloseSequence with commit. One 512-token trace block is one
page of --page-size tokens; the model (BF16 history, one pool) is registered with
--capacity-pages pages. Give the daemon's watermarks so that the LRU simulation evicts as it
does (high_watermark 1 = evict only what a call needs). Example (bench/run-replay.sh):
  kvcd-replay --trace ../shared/data/traces/mooncake_synthetic_trace.jsonl \
    --target 127.0.0.1:50051 --capacity-pages 5859 --high-watermark 1 --low-watermark 0.99)"};
  return program;
}

}  // namespace

int main(int argc, char** argv) {
  kvcd::cli::Parse(Cli(), argc, argv);
  const kvcd::cli::Program& cli = Cli();
  const std::string trace_path = absl::GetFlag(FLAGS_trace);
  if (trace_path.empty()) return kvcd::cli::UsageError(cli, nullptr, "--trace is required");
  const int64_t capacity = absl::GetFlag(FLAGS_capacity_pages);
  if (capacity <= 0) return kvcd::cli::UsageError(cli, nullptr, "--capacity-pages must be > 0");
  if (absl::GetFlag(FLAGS_requests) < 0) {
    return kvcd::cli::UsageError(cli, nullptr, "--requests must be >= 0");
  }
  const double high = absl::GetFlag(FLAGS_high_watermark), low = absl::GetFlag(FLAGS_low_watermark);
  if (!(low > 0 && low < high && high <= 1)) {
    return kvcd::cli::UsageError(
        cli, nullptr, "the watermarks must satisfy 0 < low-watermark < high-watermark <= 1");
  }
  auto trace = kvcd::replay::ReadTrace(trace_path, absl::GetFlag(FLAGS_requests));
  if (!trace.ok()) {
    std::fprintf(stderr, "kvcd-replay: %s\n", std::string(trace.status().message()).c_str());
    return 1;
  }
  kvcd::v1::ModelProfile profile;
  profile.set_name(absl::GetFlag(FLAGS_model));
  profile.set_page_size(absl::GetFlag(FLAGS_page_size));
  profile.set_num_layers(absl::GetFlag(FLAGS_layers));
  profile.set_num_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  profile.set_num_q_heads(absl::GetFlag(FLAGS_kv_heads));
  profile.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  profile.set_recent_tokens(profile.page_size());
  profile.set_history_format(kvcd::v1::HISTORY_FORMAT_BF16);
  const uint64_t page_bytes = 2ull * 2 * static_cast<uint64_t>(profile.page_size()) *
                              static_cast<uint64_t>(profile.num_layers()) *
                              static_cast<uint64_t>(profile.num_kv_heads()) *
                              static_cast<uint64_t>(profile.head_dim());  // K and V, BF16
  profile.set_memory_bytes(static_cast<uint64_t>(capacity) * page_bytes);
  auto workload = kvcd::replay::TraceWorkload::Create(*std::move(trace), profile.page_size());
  if (!workload.ok()) {
    std::fprintf(stderr, "kvcd-replay: %s\n", std::string(workload.status().message()).c_str());
    return 1;
  }
  kvcd::ClientOptions co;
  co.target = absl::GetFlag(FLAGS_target);
  co.deadline = std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  kvcd::ApplySecurityEnvironment(&co);
  std::unique_ptr<kvcd::replay::Target> target;
  kvcd::replay::ClusterTarget* cluster = nullptr;
  if (absl::GetFlag(FLAGS_members).empty()) {
    auto daemon = kvcd::replay::DaemonTarget::Connect(co);
    if (!daemon.ok()) {
      std::fprintf(stderr, "kvcd-replay: %s: %s\n", co.target.c_str(),
                   std::string(daemon.status().message()).c_str());
      return 1;
    }
    target = *std::move(daemon);
  } else {
    auto mode = kvcd::replay::ParseRoutingMode(absl::GetFlag(FLAGS_routing));
    if (!mode.ok()) return kvcd::cli::UsageError(cli, nullptr, mode.status().message());
    kvcd::replay::ClusterTargetOptions cto;
    cto.mode = *mode;
    cto.client = co;
    cto.redis_url = absl::GetFlag(FLAGS_redis_url);
    cto.cluster_name = absl::GetFlag(FLAGS_cluster_name);
    cto.pull = absl::GetFlag(FLAGS_pull);
    cto.seed = absl::GetFlag(FLAGS_seed);
    cto.routing.replicate_after = absl::GetFlag(FLAGS_replicate_after);
    cto.etcd_endpoints =
        absl::StrSplit(absl::GetFlag(FLAGS_etcd_endpoints), ',', absl::SkipEmpty());
    cto.verify_every = absl::GetFlag(FLAGS_verify_every);
    auto members = kvcd::replay::MembersFromStats(
        absl::StrSplit(absl::GetFlag(FLAGS_members), ',', absl::SkipEmpty()), co);
    if (!members.ok()) {
      std::fprintf(stderr, "kvcd-replay: %s\n", std::string(members.status().message()).c_str());
      return 1;
    }
    cto.members = *std::move(members);
    auto c = kvcd::replay::ClusterTarget::Connect(std::move(cto));
    if (!c.ok()) {
      std::fprintf(stderr, "kvcd-replay: %s\n", std::string(c.status().message()).c_str());
      return 1;
    }
    cluster = c->get();
    target = *std::move(c);
  }
  kvcd::replay::ProgressBar bar(workload->size(), absl::GetFlag(FLAGS_progress));
  kvcd::replay::ReplayOptions options;
  options.commit = absl::GetFlag(FLAGS_commit);
  options.high_watermark = high;
  options.low_watermark = low;
  options.daemon_pid = absl::GetFlag(FLAGS_daemon_pid);
  options.progress = [&](int64_t done, double hit) {
    bar.Update(done, absl::StrFormat("hit %.1f%%", 100 * hit));
  };
  std::vector<int64_t> hook_at;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_hook_at), ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(p, &v) || v < 0) {
      return kvcd::cli::UsageError(cli, nullptr,
                                   "--hook-at takes comma-separated request positions >= 0");
    }
    hook_at.push_back(v);
  }
  if (!hook_at.empty() && absl::GetFlag(FLAGS_hook).empty()) {
    return kvcd::cli::UsageError(cli, nullptr, "--hook-at needs --hook");
  }
  if (absl::GetFlag(FLAGS_verify_every) < 0) {
    return kvcd::cli::UsageError(cli, nullptr, "--verify-every must be >= 0");
  }
  if (absl::GetFlag(FLAGS_verify_every) > 0) {
    if (auto* d = dynamic_cast<kvcd::replay::DaemonTarget*>(target.get())) {
      d->set_verify_every(absl::GetFlag(FLAGS_verify_every));
    }
  }
  options.before_request = [&](int64_t i) -> absl::Status {
    for (size_t k = 0; k < hook_at.size(); ++k) {
      if (hook_at[k] != i) continue;
      const std::string cmd = absl::StrCat(absl::GetFlag(FLAGS_hook), " ", k, " ", i);
      const int rc = std::system(cmd.c_str());
      if (rc != 0) {
        return absl::AbortedError(absl::StrCat("the hook `", cmd, "` failed (", rc, ")"));
      }
    }
    return absl::OkStatus();
  };
  auto report = kvcd::replay::Replay(*workload, *target, profile, options);
  bar.Finish();
  if (!report.ok()) {
    std::fprintf(stderr, "kvcd-replay: %s\n", std::string(report.status().message()).c_str());
    return 1;
  }
  const int64_t asked = cluster != nullptr ? capacity * cluster->members() : capacity;
  if (report->capacity_pages != asked) {
    std::fprintf(stderr, "kvcd-replay: note: the daemon's pool holds %lld pages (asked %lld)\n",
                 static_cast<long long>(report->capacity_pages), static_cast<long long>(asked));
  }
  if (cluster != nullptr && !absl::GetFlag(FLAGS_cluster_json).empty()) {
    auto figures = cluster->Figures();
    if (!figures.ok()) {
      std::fprintf(stderr, "kvcd-replay: %s\n", std::string(figures.status().message()).c_str());
      return 1;
    }
    std::ofstream(absl::GetFlag(FLAGS_cluster_json)) << kvcd::replay::ClusterFiguresJson(*figures);
  }
  const std::string out = absl::GetFlag(FLAGS_json) ? kvcd::replay::ReportJson(*report, trace_path)
                                                    : kvcd::replay::ReportText(*report, trace_path);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}
