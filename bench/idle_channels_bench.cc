// idle_channels_bench: what idle decode channels cost a running kvcd (issue #35.4). It
// measures the daemon process's CPU (utime + stime from /proc/<pid>/stat) over --seconds
// and another client's Match latency, first with no channel open, then with --channels
// idle channels (opened, never sent a request, left past the daemon's spin window).
//
// The channels' regions are written here as common/decode_channel_layout.h lays them out,
// with the layout version of --layout-version, so the same tool measures a daemon that
// speaks an earlier version of the channel (1: the sleep-poll daemon) against this one (2:
// the doorbell). The daemon must run on this host (its pid: --daemon-pid).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "client/client.h"
#include "common/cli.h"
#include "common/decode_channel_layout.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "daemon address HOST:PORT");
ABSL_FLAG(int, daemon_pid, 0, "the daemon's process id (its CPU is read from /proc)");
ABSL_FLAG(std::string, model, "tiny", "model of the Match calls");
ABSL_FLAG(int, channels, 64, "idle decode channels to open");
ABSL_FLAG(double, seconds, 3, "seconds of each CPU measurement");
ABSL_FLAG(int, matches, 400, "Match calls of each latency measurement");
ABSL_FLAG(int, layout_version, kvcd::DecodeChannelHeader::kVersion,
          "the channel layout version written into the regions");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "idle_channels_bench",
      .summary = "CPU and Match latency of a kvcd with idle decode channels",
      .files = {__FILE__},
      .synopsis = R"(--daemon-pid PID [--target HOST:PORT] [--model NAME] [--channels N]
    [--seconds S] [--matches N] [--layout-version V])"};
  return program;
}

using Clock = std::chrono::steady_clock;

// utime + stime of a process, in clock ticks.
int64_t ProcessTicks(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  int64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stoll(field);
    if (i == 15) stime = std::stoll(field);
  }
  return utime + stime;
}

// Cores the daemon used over `seconds` of wall time.
double DaemonCores(int pid, double seconds) {
  const int64_t t0 = ProcessTicks(pid);
  const auto w0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const int64_t t1 = ProcessTicks(pid);
  const double wall = std::chrono::duration<double>(Clock::now() - w0).count();
  return static_cast<double>(t1 - t0) / static_cast<double>(sysconf(_SC_CLK_TCK)) / wall;
}

struct Latency {
  double p50_ms = 0, p99_ms = 0, max_ms = 0;
};

Latency MatchLatency(kvcd::Client* client, const std::string& model, int n) {
  std::vector<int32_t> tokens(64);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + 3);
  std::vector<double> ms;
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    auto m = client->Match(model, "bench-other", tokens);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    if (!m.ok()) {
      std::fprintf(stderr, "Match: %s\n", m.status().ToString().c_str());
      std::exit(1);
    }
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms[ms.size() * 99 / 100], ms.back()};
}

struct Region {
  void* p = nullptr;
  size_t bytes = 0;
  uint64_t id = 0;
};

}  // namespace

int main(int argc, char** argv) {
  kvcd::cli::Parse(Cli(), argc, argv);
  const int pid = absl::GetFlag(FLAGS_daemon_pid);
  const int n = absl::GetFlag(FLAGS_channels);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  if (pid <= 0) return kvcd::cli::UsageError(Cli(), nullptr, "--daemon-pid is required");
  if (n <= 0 || !(seconds > 0)) {
    return kvcd::cli::UsageError(Cli(), nullptr, "--channels and --seconds must be > 0");
  }
  kvcd::ClientOptions co;
  co.target = absl::GetFlag(FLAGS_target);
  co.deadline = std::chrono::seconds(60);
  auto client = kvcd::Client::Connect(co);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  const std::string model = absl::GetFlag(FLAGS_model);
  const int matches = absl::GetFlag(FLAGS_matches);

  (void)MatchLatency(client->get(), model, 50);  // warm-up
  const double idle_cores = DaemonCores(pid, seconds);
  const Latency idle_match = MatchLatency(client->get(), model, matches);

  const uint32_t capacity = kvcd::DecodeChannelHeader::kMinCapacity;
  std::vector<Region> regions;
  for (int i = 0; i < n; ++i) {
    Region r;
    r.bytes = kvcd::DecodeChannelHeader::TotalBytes(capacity);
    const std::string name =
        "/kvcd-idlebench-" + std::to_string(getpid()) + "-" + std::to_string(i);
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(r.bytes)) != 0) {
      std::perror("shm");
      return 1;
    }
    r.p = mmap(nullptr, r.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (r.p == MAP_FAILED) {
      std::perror("mmap");
      return 1;
    }
    auto* h = new (r.p) kvcd::DecodeChannelHeader{};
    h->magic = kvcd::DecodeChannelHeader::kMagic;
    h->version = static_cast<uint32_t>(absl::GetFlag(FLAGS_layout_version));
    h->capacity = capacity;
    kvcd::v1::OpenDecodeChannelRequest req;
    req.set_shm_name(name);
    req.set_lease_ms(600000);
    kvcd::v1::OpenDecodeChannelResponse resp;
    const absl::Status s = (*client)->OpenDecodeChannelRpc(req, &resp);
    shm_unlink(name.c_str());
    if (!s.ok()) {
      std::fprintf(stderr, "channel %d: %s\n", i, s.ToString().c_str());
      return 1;
    }
    r.id = resp.channel_id();
    regions.push_back(r);
  }
  // Past every channel's spin window (2 ms by default).
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double busy_cores = DaemonCores(pid, seconds);
  const Latency busy_match = MatchLatency(client->get(), model, matches);
  for (Region& r : regions) {
    (void)(*client)->CloseDecodeChannel(r.id);
    munmap(r.p, r.bytes);
  }

  std::printf("| | daemon CPU (cores, over %.1f s) | Match p50 | Match p99 | Match max |\n",
              seconds);
  std::printf("|---|---|---|---|---|\n");
  std::printf("| no channel | %.3f | %.3f ms | %.3f ms | %.3f ms |\n", idle_cores,
              idle_match.p50_ms, idle_match.p99_ms, idle_match.max_ms);
  std::printf("| %d idle channels | %.3f | %.3f ms | %.3f ms | %.3f ms |\n", n, busy_cores,
              busy_match.p50_ms, busy_match.p99_ms, busy_match.max_ms);
  std::printf("per idle channel: %.4f cores\n", (busy_cores - idle_cores) / n);
  return 0;
}
