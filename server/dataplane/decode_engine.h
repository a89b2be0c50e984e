// The two sides a decode channel (decode_channels.h) talks to, declared here, below the
// channels, so that requests flow one way: the channel reads a request, asks the
// channel's admission whether it may run (and which open sequences it names), and hands
// it down to the engine. CacheEngine implements DecodeEngine; the RPC layer gives each
// channel an admission bound to the token that opened it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvcd/v1/kvcache.pb.h"

namespace kvcd {

struct Sequence;  // server/cache/sequence.h; the data plane only passes them on

class DecodeEngine {
 public:
  virtual ~DecodeEngine() = default;
  // Runs one AttentionDecode request. `found`: the open sequences the admission found for
  // it (in the request's order; FoundSequences), or empty for the engine to find them.
  virtual absl::Status AttentionDecode(const v1::AttentionDecodeRequest& req,
                                       v1::AttentionDecodeResponse* resp,
                                       const std::vector<std::shared_ptr<Sequence>>& found) = 0;
  // A call's device signal words (decode_channel_layout.h: signal_buffer, signal_offset, and
  // the request's sequence number as the value).
  struct DeviceSignal {
    uint64_t buffer_id = 0;
    uint64_t offset = 0;
    uint32_t value = 0;
  };
  // The same, with the call's CUDA IPC buffer `signal.buffer_id` ordered through the signal
  // words instead of its events.
  virtual absl::Status AttentionDecodeSignaled(const v1::AttentionDecodeRequest& req,
                                               v1::AttentionDecodeResponse* resp,
                                               const std::vector<std::shared_ptr<Sequence>>& found,
                                               const DeviceSignal& signal) = 0;
};

class DecodeAdmission {
 public:
  virtual ~DecodeAdmission() = default;
  // Checked before each request of one channel (e.g. that the channel's credential may use
  // every sequence of the request); a failure answers the request with that status. On
  // success, the sequences it found (handed on to the engine; empty: none looked up).
  virtual absl::StatusOr<std::vector<std::shared_ptr<Sequence>>> Admit(
      const v1::AttentionDecodeRequest& req) = 0;
  // Told how each admitted request ended and how long the engine took (metrics); `resp`
  // is the engine's answer when `s` is OK.
  virtual void Answered(const absl::Status& s, double seconds,
                        const v1::AttentionDecodeResponse& resp) = 0;
  // Told once, from the channel's thread, when the channel stopped serving (closed by
  // either side, idle past its lease, drained or faulted), before the channel is reaped.
  virtual void Ended() {}
};

}  // namespace kvcd
