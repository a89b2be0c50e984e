// kvcd-replay against the real daemon on loopback: the first 200 requests of the public
// Mooncake trace (skips where ../shared/data is absent). The daemon's prefix hit rate must
// follow the LRU simulation at the same capacity, and every RPC must succeed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/integration/daemon_process.h"

namespace kvcd {
namespace replay_test {

using testing_util::DaemonProcess;

std::string TracePath() {
  for (const char* dir : {KVCD_SHARED_DATA, KVCD_SHARED_DATA_ALT}) {
    const std::string p = std::string(dir) + "/traces/mooncake_synthetic_trace.jsonl";
    if (access(p.c_str(), R_OK) == 0) return p;
  }
  return "";
}

// Runs kvcd-replay with `args`; returns its stdout and sets *status to its exit status.
std::string RunReplay(const std::string& args, int* status) {
  const std::string cmd = std::string(KVCD_REPLAY_BINARY) + " " + args + " --json --progress=false";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *status = -1;
    return "";
  }
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  *status = pclose(p);
  return out;
}

struct Case {
  const char* name;
  double high, low;
  int64_t capacity;
};

class ReplayTest : public ::testing::TestWithParam<Case> {};

TEST_P(ReplayTest, DaemonHitRateFollowsTheLruSimulation) {
  const std::string trace = TracePath();
  if (trace.empty()) GTEST_SKIP() << "no trace under ../shared/data/traces";
  const Case c = GetParam();
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.CaptureStderr());
  ASSERT_TRUE(
      daemon.Start("listen: 127.0.0.1:0\nmetrics_listen: \"\"\nbackend: cpu\n"
                   "memory_budget: 64MiB\nworker_threads: 2\ncompute_threads: 1\n"
                   "high_watermark: " +
                   std::to_string(c.high) + "\nlow_watermark: " + std::to_string(c.low) + "\n"))
      << daemon.Stderr();
  int status = 0;
  const std::string out =
      RunReplay("--trace " + trace + " --requests 200 --target " + daemon.grpc() +
                    " --capacity-pages " + std::to_string(c.capacity) + " --high-watermark " +
                    std::to_string(c.high) + " --low-watermark " + std::to_string(c.low),
                &status);
  // A failed RPC stops the replay with a non-zero status.
  ASSERT_EQ(status, 0) << out << daemon.Stderr();
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["requests"].get<int64_t>(), 200);
  // Match, Put (where something missed), OpenSequence, Append, CloseSequence: all answered.
  int64_t calls = 0;
  for (const char* call : {"Match", "OpenSequence", "Append", "CloseSequence"}) {
    EXPECT_EQ(j["latency"][call]["calls"].get<int64_t>(), 200) << call;
    calls += j["latency"][call]["calls"].get<int64_t>();
  }
  EXPECT_GT(j["latency"]["Put"]["calls"].get<int64_t>(), 0);
  EXPECT_EQ(j["rpcs"].get<int64_t>(), calls + j["latency"]["Put"]["calls"].get<int64_t>());
  EXPECT_EQ(j["capacity_pages"].get<int64_t>(), c.capacity);
  // The capacity is small enough that the daemon evicted, and some prompts hit.
  EXPECT_GT(j["evicted_pages"].get<int64_t>(), 0);
  const double daemon_hit = j["daemon"]["hit_rate"].get<double>();
  const double lru_hit = j["lru_simulation"]["hit_rate"].get<double>();
  EXPECT_GT(daemon_hit, 0);
  EXPECT_LE(std::abs(daemon_hit - lru_hit), 0.01)
      << "daemon " << daemon_hit << " LRU " << lru_hit
      << "; requests matched differently: " << j["lru_mismatched_requests"];
  EXPECT_LE(daemon_hit, j["infinite"]["hit_rate"].get<double>() + 1e-12);
  EXPECT_EQ(daemon.Stop(), 0);
}

// Pure LRU at capacity (evict only what a call needs) and the daemon's default watermarks.
INSTANTIATE_TEST_SUITE_P(Watermarks, ReplayTest,
                         ::testing::Values(Case{"PureLru", 1.0, 0.99, 1000},
                                           Case{"DefaultWatermarks", 0.95, 0.85, 1000}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace replay_test
}  // namespace kvcd
