// DecodeChannel: the client side of the same-node decode fast path (OpenDecodeChannel).
// Same Call() contract as DecodeStream — one request at a time, answered in order, a
// per-request error returned as that status — but the request and the answer go through
// a POSIX shared memory object instead of through gRPC (this side spins for the answer; the
// daemon's side sleeps on the region's doorbell while the channel is idle). The daemon
// must run on the same host (NOT_FOUND otherwise: fall back to OpenDecodeStream).
//
// Thread safety: a DecodeChannel may not be shared by threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/decode_channel_layout.h"

namespace kvcd {

class DecodeChannel {
 public:
  // capacity: bytes of each message area (requests and answers must fit; with CUDA IPC
  // tensors they are a few hundred bytes). lease_ms: the daemon closes the channel after
  // this long without a request (0 = its default lease).
  static absl::StatusOr<std::unique_ptr<DecodeChannel>> Open(Client* client,
                                                             uint32_t capacity = 1u << 20,
                                                             int64_t lease_ms = 0);
  ~DecodeChannel();  // Close()

  // Waits for the answer at most the client's deadline (DEADLINE_EXCEEDED; the channel
  // is unusable afterwards). UNAVAILABLE once the daemon closed the channel.
  absl::StatusOr<v1::AttentionDecodeResponse> Call(const v1::AttentionDecodeRequest& req);
  absl::Status Close();
  uint64_t id() const { return id_; }
  // Device signal words for the calls that follow (decode_channel_layout.h, issue #36): the
  // registered buffer `buffer_id` holds at `offset` (a multiple of 8) the worker's ready word,
  // then the daemon's done word, and the daemon orders that buffer through them instead of
  // its IPC events. 0 = none (the events again).
  void SetDeviceSignal(uint64_t buffer_id, uint64_t offset);
  // The value of the next call's signal words (its sequence number, cyclic): write it into
  // the ready word before Call, wait for the done word to reach it after an OK answer.
  uint32_t NextSignalValue() const { return static_cast<uint32_t>(seq_ + 1); }

 private:
  DecodeChannel() = default;
  Client* client_ = nullptr;
  DecodeChannelHeader* header_ = nullptr;
  size_t bytes_ = 0;
  uint64_t id_ = 0;
  uint64_t seq_ = 0;
  bool broken_ = false;
  std::string scratch_;
};

}  // namespace kvcd
