// GpuTimeline: where the GPU time of the per-layer decode loop goes on the daemon's side
// (issue #19), as PhaseTimes phases. Timing events on the daemon's stream mark a call:
//   Start()         after the stream wait for the call's inputs (the last one if several);
//   Step(phase)     after a stage of the call: the GPU time since the previous mark goes to
//                   `phase` (a PhaseTimes id, e.g. "gpu.daemon attention bf16");
//   End()           before the worker's done event: the time since the last mark goes to
//                   "gpu.daemon tail (-> done)";
// and the call's whole span to "gpu.daemon busy (inputs ready -> done)", the time from one
// call's End to the next call's Start (the worker's GPU work and both cross-process hops) to
// "gpu.daemon idle (done -> next inputs ready)". A call's spans are resolved without
// waiting once its End has completed (cudaEventQuery), at a later mark. Only in the CUDA
// backend with KVCD_PHASE_TIMES=1. Thread-safe (one decode worker at a time gives clean
// spans).
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

  void Start() { Mark(kStart, -1); }
  void Step(int phase) { Mark(kStep, phase); }
  void End() { Mark(kEnd, tail_phase_); }

 private:
  enum Kind { kStart, kStep, kEnd };
  struct Marked {
    void* event;
    Kind kind;
    int phase;
  };
  void Mark(Kind kind, int phase);
  void ResolveLocked();
  void* TakeEventLocked();
  void RecycleLocked(void* event);
  void DropFrontLocked();

  std::mutex mu_;
  std::deque<Marked> marks_;
  std::vector<void*> free_;
  void* last_end_ = nullptr;  // the previous call's End, where the next idle span starts
  bool failed_ = false;       // a CUDA error: marking stops (the timeline is only a report)
  int busy_phase_ = -1, idle_phase_ = -1, tail_phase_ = -1;
};

}  // namespace kvcd
