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
      idle_phase_(PhaseTimes::Phase("gpu.daemon idle (done -> next inputs ready)")) {}

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
  if (!kc::CreateTimingEvent(&e).empty()) return nullptr;
  return e;
}

void GpuTimeline::RecycleLocked(void* event) {
  if (event != nullptr) free_.push_back(event);
}

void GpuTimeline::Mark(bool start) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  ResolveLocked();
  if (marks_.size() >= kMaxPending) {
    for (const Marked& m : marks_) RecycleLocked(m.event);
    marks_.clear();
  }
  void* e = TakeEventLocked();
  if (e == nullptr || !kc::RecordTimingEvent(e).empty()) {
    failed_ = true;
    RecycleLocked(e);
    return;
  }
  marks_.push_back({e, start});
}

// Marks come as S.. E.. S.. E..: a call's last start mark and its first end mark bound its
// busy span; that end and the next call's last start bound the idle span between calls.
void GpuTimeline::ResolveLocked() {
  while (!marks_.empty()) {
    const Marked front = marks_.front();
    if (!front.start) {  // an end with no start before it (another kind of call): forget it
      marks_.pop_front();
      RecycleLocked(front.event);
      continue;
    }
    if (marks_.size() < 2) return;
    const Marked next = marks_[1];
    if (next.start) {  // several waits in one call: the last one starts the span
      marks_.pop_front();
      RecycleLocked(front.event);
      continue;
    }
    bool done = false;
    float busy_ms = 0, idle_ms = 0;
    if (!kc::ElapsedIfDone(front.event, next.event, &done, &busy_ms).empty()) {
      failed_ = true;
      return;
    }
    if (!done) return;
    PhaseTimes::Add(busy_phase_, static_cast<int64_t>(busy_ms * 1e6f));
    if (last_end_ != nullptr) {
      bool idle_done = false;
      if (kc::ElapsedIfDone(last_end_, front.event, &idle_done, &idle_ms).empty() && idle_done) {
        PhaseTimes::Add(idle_phase_, static_cast<int64_t>(idle_ms * 1e6f));
      }
      RecycleLocked(last_end_);
    }
    last_end_ = next.event;
    RecycleLocked(front.event);
    marks_.pop_front();
    marks_.pop_front();
  }
}

}  // namespace kvcd
