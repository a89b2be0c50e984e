// DecodeChannels: the daemon side of the same-node decode fast path (OpenDecodeChannel).
// Each channel maps the worker's shared memory and runs one thread that waits for
// requests (spinning for spin_us after each request, then sleeping on the region's
// doorbell, a futex word: an idle channel costs no CPU), asks
// the channel's admission for each, hands it down to the engine (decode_engine.h) and
// writes the answers back. A channel ends on Close, when the worker sets the closed flag, after
// lease_ms without a request, or when the daemon drains (CloseAll); its thread then sets the
// closed flag. One object is served by at most one channel: a second Open on it is refused,
// so no channel's end ever writes into a region another channel serves.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "kvcd/v1/kvcache.pb.h"
#include "server/dataplane/decode_engine.h"

namespace kvcd {

class DecodeChannels {
 public:
  struct Options {
    int64_t spin_us = 2000;
    int max_channels = 64;
  };
  // engine must outlive the channels.
  DecodeChannels(DecodeEngine* engine, Options options);
  ~DecodeChannels();

  // INVALID_ARGUMENT for a bad name or layout, NOT_FOUND if the object does not exist,
  // ALREADY_EXISTS if an open channel serves the same object (under any name: the object's
  // device and inode decide), RESOURCE_EXHAUSTED past max_channels. A refused open writes
  // nothing into the object. Without an admission every request runs, on
  // the sequences the engine finds.
  absl::StatusOr<uint64_t> Open(const std::string& shm_name, int64_t lease_ms,
                                std::unique_ptr<DecodeAdmission> admission = nullptr);
  absl::Status Close(uint64_t id);
  void CloseAll();
  int64_t size() const;
  uint64_t served() const { return served_.load(); }

 private:
  struct Channel;
  void Serve(Channel* c);
  // Sleeps on c's doorbell for at most `timeout` unless a request past `seen`, `closed` or
  // a stop is already there. False if the mapping faulted.
  static bool Sleep(Channel* c, uint64_t seen, std::chrono::steady_clock::duration timeout);
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ServedLocked(dev_t dev, ino_t ino) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::Status AlreadyServed(const std::string& name);

  DecodeEngine* const engine_;
  const Options options_;
  std::atomic<uint64_t> served_{0};
  mutable std::mutex mu_;
  std::map<uint64_t, std::unique_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcd
