// Layout of a decode channel's shared memory (OpenDecodeChannel), shared by the daemon and
// the client library. One request in flight at a time:
//   worker: write the serialized AttentionDecodeRequest at RequestArea(), set
//           request_bytes, then request_seq = previous + 1 (release);
//   daemon: sees request_seq change (acquire), runs it, writes the serialized
//           AttentionDecodeStreamResponse at ResponseArea(), sets response_bytes, then
//           response_seq = request_seq (release);
//   worker: sees response_seq == its request_seq (acquire) and reads the answer.
// Either side sets `closed` to end the channel. The atomics are lock-free and
// address-free, so they synchronize across processes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace kvcd {

struct DecodeChannelHeader {
  static constexpr uint64_t kMagic = 0x314e4843'4443564bull;  // "KVCDCHN1"
  static constexpr uint32_t kVersion = 1;
  static constexpr uint32_t kMinCapacity = 4096;
  static constexpr uint32_t kMaxCapacity = 64u << 20;
  static constexpr size_t kAreasOffset = 256;

  uint64_t magic;
  uint32_t version;
  uint32_t capacity;  // bytes of each message area
  alignas(64) std::atomic<uint64_t> request_seq;
  std::atomic<uint32_t> request_bytes;
  alignas(64) std::atomic<uint64_t> response_seq;
  std::atomic<uint32_t> response_bytes;
  alignas(64) std::atomic<uint32_t> closed;

  static size_t TotalBytes(uint32_t capacity) { return kAreasOffset + 2 * size_t{capacity}; }
  uint8_t* RequestArea() { return reinterpret_cast<uint8_t*>(this) + kAreasOffset; }
  uint8_t* ResponseArea() { return RequestArea() + capacity; }
};
static_assert(sizeof(DecodeChannelHeader) <= DecodeChannelHeader::kAreasOffset, "header size");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process atomics");

}  // namespace kvcd
