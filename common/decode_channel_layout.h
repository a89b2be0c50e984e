// Layout of a decode channel's shared memory (OpenDecodeChannel), shared by the daemon and
// the client library. One request in flight at a time:
//   worker: write the serialized AttentionDecodeRequest at RequestArea(), set
//           request_bytes, then PublishRequest(previous + 1): request_seq, then the doorbell;
//   daemon: sees request_seq change (acquire), runs it, writes the serialized
//           AttentionDecodeStreamResponse at ResponseArea(), sets response_bytes, then
//           response_seq = request_seq (release);
//   worker: sees response_seq == its request_seq (acquire) and reads the answer.
// Either side ends the channel: the worker with Close() (`closed`, then the doorbell), the
// daemon by setting `closed`. The atomics are lock-free and address-free, so they
// synchronize across processes.
//
// The doorbell (version 2): after a short spin the daemon's thread sleeps on the futex word
// `doorbell` (FUTEX_WAIT on the shared mapping, so it costs nothing while idle) with
// `daemon_waiting` set. The worker bumps `doorbell` after every change it publishes and
// wakes the daemon when `daemon_waiting` is set. Both sides' stores and loads are seq_cst:
// either the worker sees daemon_waiting set (and wakes it), or the daemon, re-reading
// request_seq and closed after setting it, sees the change (and does not sleep); a bump
// between the daemon's read of `doorbell` and its FUTEX_WAIT fails the wait at once.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>

namespace kvcd {

struct DecodeChannelHeader {
  static constexpr uint64_t kMagic = 0x314e4843'4443564bull;  // "KVCDCHN1"
  static constexpr uint32_t kVersion = 2;                     // 2: the doorbell
  static constexpr uint32_t kMinCapacity = 4096;
  static constexpr uint32_t kMaxCapacity = 64u << 20;
  static constexpr size_t kAreasOffset = 256;

  uint64_t magic;
  uint32_t version;
  uint32_t capacity;  // bytes of each message area
  alignas(64) std::atomic<uint64_t> request_seq;
  std::atomic<uint32_t> request_bytes;
  // Device signal words (issue #36), set by the worker before it publishes a request; 0 =
  // none (the IPC buffers' events order the call). signal_buffer: the id of a registered
  // buffer (RegisterBuffer); signal_offset: 8 bytes in it (a multiple of 8), the worker's
  // ready word then the daemon's done word. With them, for the request of sequence number
  // seq, the daemon's stream waits until ready >= (uint32_t)seq (cyclically) before reading
  // that buffer, and writes (uint32_t)seq into done after writing into it (on an OK answer),
  // in place of that buffer's events (stream memory operations: cuStreamWaitValue32 /
  // cuStreamWriteValue32, no host in the path).
  std::atomic<uint64_t> signal_buffer;
  std::atomic<uint64_t> signal_offset;
  alignas(64) std::atomic<uint64_t> response_seq;
  std::atomic<uint32_t> response_bytes;
  alignas(64) std::atomic<uint32_t> closed;
  std::atomic<uint32_t> doorbell;        // futex word: bumped after each published change
  std::atomic<uint32_t> daemon_waiting;  // nonzero while the daemon may sleep on doorbell

  // The worker's side of the doorbell: request_seq, then the bell.
  void PublishRequest(uint64_t seq) {
    request_seq.store(seq, std::memory_order_seq_cst);
    Ring();
  }
  // Ends the channel from the worker's side and wakes the daemon to see it.
  void Close() {
    closed.store(1, std::memory_order_seq_cst);
    Ring();
  }
  void Ring() {
    doorbell.fetch_add(1, std::memory_order_seq_cst);
    if (daemon_waiting.load(std::memory_order_seq_cst) != 0) WakeAll(&doorbell);
  }
  // FUTEX_WAKE on a shared mapping (no FUTEX_PRIVATE_FLAG: the waiter is another process).
  static void WakeAll(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }

  static size_t TotalBytes(uint32_t capacity) { return kAreasOffset + 2 * size_t{capacity}; }
  uint8_t* RequestArea() { return reinterpret_cast<uint8_t*>(this) + kAreasOffset; }
  uint8_t* ResponseArea() { return RequestArea() + capacity; }
};
static_assert(sizeof(DecodeChannelHeader) <= DecodeChannelHeader::kAreasOffset, "header size");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process atomics");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "the doorbell is a 32-bit futex word");

}  // namespace kvcd
