#include "common/phase_times.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace kvcd {
namespace {

struct Table {
  std::mutex mu;  // registration only
  std::atomic<int> n{0};
  std::array<std::string, PhaseTimes::kMaxPhases> names;
  std::array<std::array<std::atomic<uint64_t>, PhaseTimes::kBuckets>, PhaseTimes::kMaxPhases>
      buckets{};
  std::array<std::atomic<uint64_t>, PhaseTimes::kMaxPhases> count{};
  std::array<std::atomic<uint64_t>, PhaseTimes::kMaxPhases> sum{};
};

Table& T() {
  static Table* t = new Table();  // never destroyed: phases may be added during exit
  return *t;
}

bool FromEnvironment() {
  const char* v = std::getenv("KVCD_PHASE_TIMES");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace

std::atomic<bool> PhaseTimes::enabled_{FromEnvironment()};

int PhaseTimes::Bucket(uint64_t v) {
  if (v < 16) return static_cast<int>(v);
  const int o = 63 - __builtin_clzll(v);  // >= 4
  const int sub = static_cast<int>((v >> (o - 4)) & 15);
  return 16 + (o - 4) * 16 + sub;  // at most 16 + 59 * 16 + 15 = 975
}

double PhaseTimes::BucketValue(int b) {
  if (b < 16) return b;
  const int o = (b - 16) / 16 + 4, sub = (b - 16) % 16;
  // Values in the bucket: [(16 + sub) << (o - 4), (17 + sub) << (o - 4)).
  return (16.0 + sub + 0.5) * static_cast<double>(uint64_t{1} << (o - 4));
}

int PhaseTimes::Phase(std::string_view name) {
  Table& t = T();
  std::lock_guard<std::mutex> lock(t.mu);
  const int n = t.n.load();
  for (int i = 0; i < n; ++i) {
    if (t.names[static_cast<size_t>(i)] == name) return i;
  }
  if (n >= kMaxPhases) return -1;
  t.names[static_cast<size_t>(n)] = std::string(name);
  t.n.store(n + 1);
  return n;
}

void PhaseTimes::Add(int id, int64_t value) {
  if (id < 0 || id >= kMaxPhases) return;
  Table& t = T();
  const uint64_t v = value < 0 ? 0 : static_cast<uint64_t>(value);
  const auto i = static_cast<size_t>(id);
  t.buckets[i][static_cast<size_t>(Bucket(v))].fetch_add(1, std::memory_order_relaxed);
  t.count[i].fetch_add(1, std::memory_order_relaxed);
  t.sum[i].fetch_add(v, std::memory_order_relaxed);
}

uint64_t PhaseTimes::Count(int id) {
  if (id < 0 || id >= kMaxPhases) return 0;
  return T().count[static_cast<size_t>(id)].load(std::memory_order_relaxed);
}

double PhaseTimes::Quantile(int id, double q) {
  if (id < 0 || id >= kMaxPhases) return 0;
  Table& t = T();
  const auto& b = t.buckets[static_cast<size_t>(id)];
  uint64_t total = 0;
  for (const auto& x : b) total += x.load(std::memory_order_relaxed);
  if (total == 0) return 0;
  // The smallest bucket whose cumulative count reaches ceil(q * total) (nearest rank).
  uint64_t rank = static_cast<uint64_t>(q * static_cast<double>(total));
  if (static_cast<double>(rank) < q * static_cast<double>(total)) ++rank;
  if (rank == 0) rank = 1;
  uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += b[static_cast<size_t>(i)].load(std::memory_order_relaxed);
    if (seen >= rank) return BucketValue(i);
  }
  return BucketValue(kBuckets - 1);
}

std::string PhaseTimes::Report(std::string_view title) {
  Table& t = T();
  std::string out = "phase times: " + std::string(title) + "\n";
  char line[256];
  std::snprintf(line, sizeof(line), "  %-44s %9s %10s %10s %10s\n", "phase (us; # = count/call)",
                "calls", "mean", "p50", "p90");
  out += line;
  const int n = t.n.load();
  for (int i = 0; i < n; ++i) {
    const uint64_t c = Count(i);
    if (c == 0) continue;
    const std::string& name = t.names[static_cast<size_t>(i)];
    const bool counter = !name.empty() && name[0] == '#';
    const double scale = counter ? 1.0 : 1e-3;
    const double mean =
        static_cast<double>(t.sum[static_cast<size_t>(i)].load()) / static_cast<double>(c);
    std::snprintf(line, sizeof(line), "  %-44s %9llu %10.2f %10.2f %10.2f\n", name.c_str(),
                  static_cast<unsigned long long>(c), mean * scale, Quantile(i, 0.5) * scale,
                  Quantile(i, 0.9) * scale);
    out += line;
  }
  return out;
}

void PhaseTimes::Reset() {
  Table& t = T();
  const int n = t.n.load();
  for (int i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    for (auto& x : t.buckets[k]) x.store(0, std::memory_order_relaxed);
    t.count[k].store(0, std::memory_order_relaxed);
    t.sum[k].store(0, std::memory_order_relaxed);
  }
}

}  // namespace kvcd
