// ThreadPool: a fixed set of worker threads for request execution (Submit) and for
// data-parallel kernels (ParallelFor, where the calling thread takes part).
// Thread safety: all methods are thread-safe. The destructor drains queued tasks.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace kvcd {

class ThreadPool {
 public:
  // num_threads = 0 uses std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Submit(std::function<void()> task);

  // Runs fn(i) for i in [0, n) on the pool and the calling thread; returns when all
  // are done. Must not be called from inside a pool task of the same pool.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvcd
