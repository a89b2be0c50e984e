// GpuTimeline: where the GPU time of the per-layer decode loop goes on the daemon's side
// (issue #19), as two PhaseTimes phases:
//   "gpu.daemon busy (inputs ready -> done)": from the moment the daemon's stream passes its
//     wait for the worker's inputs to the worker's done event (the daemon's kernels and the
//     gaps between them);
//   "gpu.daemon idle (done -> next inputs ready)": from that done event to the next call's
//     inputs (the worker's GPU work and the two cross-process hops).
// Timing events on the daemon's stream mark both ends; a span is resolved without waiting
// once its end has completed (cudaEventQuery), at the next mark. Only built into the CUDA
// backend when KVCD_PHASE_TIMES=1. Thread-safe.
#pragma once

#include <deque>
#include <mutex>
#include <vector>

namespace kvcd {

class GpuTimeline {
 public:
  GpuTimeline();
  ~GpuTimeline();
  GpuTimeline(const GpuTimeline&) = delete;
  GpuTimeline& operator=(const GpuTimeline&) = delete;

  // After the stream wait for a call's inputs / before recording its done event.
  void Start() { Mark(true); }
  void End() { Mark(false); }

 private:
  struct Marked {
    void* event;
    bool start;
  };
  void Mark(bool start);
  void ResolveLocked();
  void* TakeEventLocked();
  void RecycleLocked(void* event);

  std::mutex mu_;
  std::deque<Marked> marks_;
  std::vector<void*> free_;
  void* last_end_ = nullptr;  // the done mark the next busy span's idle span starts from
  bool failed_ = false;       // a CUDA error: marking stops (the timeline is only a report)
  int busy_phase_ = -1, idle_phase_ = -1;
};

}  // namespace kvcd
