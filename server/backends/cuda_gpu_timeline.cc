#include "server/backends/cuda_gpu_timeline.h"

#include <cstdint>

#include "common/phase_times.h"
#include "kvcd/kernels/cuda_runtime_api.h"

namespace kvcd {

namespace kc = kernels::cuda;

namespace {
constexpr size_t kMaxPending = 4096;  // beyond: the marks are dropped (nothing resolves them)
}

GpuTimeline::GpuTimeline()
    : busy_phase_(PhaseTimes::Phase("gpu.daemon busy (inputs ready -> done)")),
      idle_phase_(PhaseTimes::Phase("gpu.daemon idle (done -> next inputs ready)")),
      tail_phase_(PhaseTimes::Phase("gpu.daemon tail (-> done)")) {}

GpuTimeline::~GpuTimeline() {
  for (const Marked& m : marks_) (void)kc::DestroyEvent(m.event);
  for (void* e : free_) (void)kc::DestroyEvent(e);
  if (last_end_ != nullptr) (void)kc::DestroyEvent(last_end_);
}

void* GpuTimeline::TakeEventLocked() {
  if (!free_.empty()) {
    void* e = free_.back();
    free_.pop_back();
    return e;
  }
  void* e = nullptr;
  if (!kc::CreateTimingEvent(&e).ok()) return nullptr;
  return e;
}

void GpuTimeline::RecycleLocked(void* event) {
  if (event != nullptr) free_.push_back(event);
}

void GpuTimeline::DropFrontLocked() {
  RecycleLocked(marks_.front().event);
  marks_.pop_front();
}

void GpuTimeline::Mark(Kind kind, int phase) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  ResolveLocked();
  if (marks_.size() >= kMaxPending) {
    while (!marks_.empty()) DropFrontLocked();
  }
  void* e = TakeEventLocked();
  if (e == nullptr || !kc::RecordTimingEvent(e).ok()) {
    failed_ = true;
    RecycleLocked(e);
    return;
  }
  marks_.push_back({e, kind, phase});
}

// A call is Start, Step.., End. Marks outside that shape (steps or ends of calls that did
// not start with a wait, several starts) are dropped: a call's last Start begins it.
void GpuTimeline::ResolveLocked() {
  while (!marks_.empty()) {
    if (marks_.front().kind != kStart) {
      DropFrontLocked();
      continue;
    }
    size_t end = 1;
    while (end < marks_.size() && marks_[end].kind == kStep) ++end;
    if (end == marks_.size()) return;  // the call's End is not recorded yet
    if (marks_[end].kind == kStart) {  // a start with no end before the next start
      DropFrontLocked();
      continue;
    }
    bool done = false;
    float ms = 0;
    if (!kc::ElapsedIfDone(marks_.front().event, marks_[end].event, &done, &ms).ok()) {
      failed_ = true;
      return;
    }
    if (!done) return;
    PhaseTimes::Add(busy_phase_, static_cast<int64_t>(ms * 1e6f));
    for (size_t i = 1; i <= end; ++i) {
      if (kc::ElapsedIfDone(marks_[i - 1].event, marks_[i].event, &done, &ms).ok() && done) {
        PhaseTimes::Add(marks_[i].phase, static_cast<int64_t>(ms * 1e6f));
      }
    }
    if (last_end_ != nullptr) {
      if (kc::ElapsedIfDone(last_end_, marks_.front().event, &done, &ms).ok() && done) {
        PhaseTimes::Add(idle_phase_, static_cast<int64_t>(ms * 1e6f));
      }
      RecycleLocked(last_end_);
    }
    last_end_ = marks_[end].event;
    for (size_t i = 0; i < end; ++i) DropFrontLocked();
    marks_.pop_front();  // the End, kept as last_end_
  }
}

}  // namespace kvcd
