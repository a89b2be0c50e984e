// PhaseTimes: a low-overhead timeline of where the host time of a hot call goes. Each
// phase is a named histogram of durations (steady clock, nanoseconds) with log-spaced
// buckets of ~4% width; a report gives count, mean, p50 and p90 per phase. Counters (CUDA
// launches per call, copies per call) use the same histograms with exact buckets below 16.
//
// Off unless the environment sets KVCD_PHASE_TIMES=1 (read once): a PhaseLap then costs
// one predictable branch and takes no clock reading. On, a lap is one clock read and a
// few relaxed atomic adds; no locks, no allocation.
//
//   static const int kParse = PhaseTimes::Phase("channel.parse");
//   PhaseLap lap;          // starts the clock
//   ... parse ...
//   lap.Mark(kParse);      // adds the time since the start (or the last Mark) to kParse
//
// Thread safety: Phase(), Add(), Report() and Reset() may run concurrently; a report taken
// while others add may miss those samples. Phases are process-global (at most kMaxPhases).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvcd {

class PhaseTimes {
 public:
  static constexpr int kMaxPhases = 96;
  static constexpr int kBuckets = 1024;

  // Whether KVCD_PHASE_TIMES=1 (or PhaseTimes::SetEnabled(true) in tests).
  static bool Enabled() { return enabled_.load(std::memory_order_relaxed); }
  static void SetEnabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }

  // The id of the phase named `name` (registered on first use; the same name gives the same
  // id). Names that are counters, not times, start with '#'. Returns -1 past kMaxPhases.
  static int Phase(std::string_view name);
  // Adds one sample (nanoseconds for a time, a count for a counter) to phase `id`.
  static void Add(int id, int64_t value);
  // The table of every phase with samples, in registration order, one line each:
  // name, count, mean, p50, p90 (microseconds for times, plain numbers for counters).
  static std::string Report(std::string_view title);
  // Drops every sample (names stay registered).
  static void Reset();

  // Bucket of a value and the value a bucket stands for (its midpoint); exposed for tests.
  static int Bucket(uint64_t v);
  static double BucketValue(int bucket);
  // The q-quantile (0..1) of one phase's samples, by its buckets; 0 when it has none.
  static double Quantile(int id, double q);
  static uint64_t Count(int id);

 private:
  static std::atomic<bool> enabled_;
};

// Measures consecutive phases of one call on one thread; does nothing when disabled.
class PhaseLap {
 public:
  using Clock = std::chrono::steady_clock;
  PhaseLap() : on_(PhaseTimes::Enabled()) {
    if (on_) last_ = Clock::now();
  }
  // Adds the time since construction or the previous Mark to `phase` and restarts.
  void Mark(int phase) {
    if (!on_) return;
    const Clock::time_point now = Clock::now();
    PhaseTimes::Add(phase,
                    std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count());
    last_ = now;
  }
  // Restarts without recording (time spent elsewhere).
  void Skip() {
    if (on_) last_ = Clock::now();
  }
  bool on() const { return on_; }

 private:
  bool on_;
  Clock::time_point last_;
};

}  // namespace kvcd
