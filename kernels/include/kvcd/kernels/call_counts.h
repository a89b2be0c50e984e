// Process-wide counts of the CUDA work the kernels' host APIs enqueue: kernel launches,
// copies by direction, event records and stream waits. Read before and after a call, the
// difference is that call's work (exact while one thread enqueues). Relaxed atomics: one
// uncontended add per enqueued operation, far below the cost of the CUDA call itself.
#pragma once

#include <atomic>
#include <cstdint>

namespace kvcd::kernels {

struct CallCounts {
  std::atomic<uint64_t> launches{0};
  std::atomic<uint64_t> h2d{0};  // host-to-device copies (synchronous or asynchronous)
  std::atomic<uint64_t> d2h{0};
  std::atomic<uint64_t> d2d{0};
  std::atomic<uint64_t> event_records{0};
  std::atomic<uint64_t> stream_waits{0};  // waits of the stream on an event
  std::atomic<uint64_t> host_syncs{0};    // the host waiting for the device
};

inline CallCounts& Counts() {
  static CallCounts c;
  return c;
}

inline void CountLaunch(uint64_t n = 1) {
  Counts().launches.fetch_add(n, std::memory_order_relaxed);
}

}  // namespace kvcd::kernels
