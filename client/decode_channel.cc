#include "client/decode_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/phase_times.h"

namespace kvcd {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeChannel>> DecodeChannel::Open(Client* client,
                                                                   uint32_t capacity,
                                                                   int64_t lease_ms) {
  if (capacity < DecodeChannelHeader::kMinCapacity ||
      capacity > DecodeChannelHeader::kMaxCapacity) {
    return absl::InvalidArgumentError(absl::StrCat("capacity is ", capacity, ", expected ",
                                                   DecodeChannelHeader::kMinCapacity, "..",
                                                   DecodeChannelHeader::kMaxCapacity));
  }
  std::unique_ptr<DecodeChannel> ch(new DecodeChannel());
  ch->client_ = client;
  ch->bytes_ = DecodeChannelHeader::TotalBytes(capacity);
  std::random_device rd;
  const std::string name = absl::StrCat("/kvcd-", getpid(), "-", rd(), rd());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("shm_open ", name, ": ", std::strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(ch->bytes_)) != 0) {
    const int e = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::InternalError(absl::StrCat("ftruncate ", name, ": ", std::strerror(e)));
  }
  void* p = mmap(nullptr, ch->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::InternalError(absl::StrCat("mmap ", name, ": ", std::strerror(errno)));
  }
  auto* h = new (p) DecodeChannelHeader();
  h->magic = DecodeChannelHeader::kMagic;
  h->version = DecodeChannelHeader::kVersion;
  h->capacity = capacity;
  h->request_seq.store(0);
  h->request_bytes.store(0);
  h->response_seq.store(0);
  h->response_bytes.store(0);
  h->closed.store(0);
  h->doorbell.store(0);
  h->daemon_waiting.store(0, std::memory_order_release);
  ch->header_ = h;
  v1::OpenDecodeChannelRequest req;
  req.set_shm_name(name);
  req.set_lease_ms(lease_ms);
  v1::OpenDecodeChannelResponse resp;
  absl::Status s = client->OpenDecodeChannelRpc(req, &resp);
  shm_unlink(name.c_str());  // both sides hold the mapping; the name is no longer needed
  if (!s.ok()) return s;
  ch->id_ = resp.channel_id();
  return ch;
}

DecodeChannel::~DecodeChannel() {
  (void)Close();
  if (header_ != nullptr) munmap(header_, bytes_);
}

void DecodeChannel::SetDeviceSignal(uint64_t buffer_id, uint64_t offset) {
  if (header_ == nullptr) return;
  // Published with the next request (PublishRequest's seq_cst store of request_seq).
  header_->signal_offset.store(offset, std::memory_order_relaxed);
  header_->signal_buffer.store(buffer_id, std::memory_order_relaxed);
}

absl::StatusOr<v1::AttentionDecodeResponse> DecodeChannel::Call(
    const v1::AttentionDecodeRequest& req) {
  if (broken_ || header_ == nullptr) {
    return absl::FailedPreconditionError("the decode channel is closed or broken");
  }
  DecodeChannelHeader& h = *header_;
  if (h.closed.load(std::memory_order_acquire) != 0) {
    return absl::UnavailableError(
        "the daemon closed the decode channel (idle past its lease, "
        "or draining); open a new one");
  }
  static const int kWrite = PhaseTimes::Phase("worker.channel.serialize+write request");
  static const int kWait = PhaseTimes::Phase("worker.channel.doorbell->answer (spin)");
  static const int kParse = PhaseTimes::Phase("worker.channel.parse answer");
  PhaseLap lap;
  const size_t n = req.ByteSizeLong();
  if (n > h.capacity) {
    // The number is spent all the same: a ready word the caller already wrote for it must
    // not satisfy the daemon's wait for the next call (device signal words).
    ++seq_;
    return absl::InvalidArgumentError(absl::StrCat(
        "the request has ", n, " bytes, more than the channel's capacity ", h.capacity));
  }
  req.SerializeWithCachedSizesToArray(h.RequestArea());
  h.request_bytes.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
  const uint64_t seq = ++seq_;
  lap.Mark(kWrite);
  h.PublishRequest(seq);  // request_seq, then the doorbell (wakes an idle daemon thread)
  const auto deadline = std::chrono::steady_clock::now() + client_->options().deadline;
  for (uint64_t spins = 0; h.response_seq.load(std::memory_order_acquire) != seq; ++spins) {
    CpuRelax();
    if ((spins & 1023) == 1023) {
      if (h.closed.load(std::memory_order_acquire) != 0 &&
          h.response_seq.load(std::memory_order_acquire) != seq) {
        broken_ = true;
        return absl::UnavailableError("the daemon closed the decode channel during a call");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        broken_ = true;
        return absl::DeadlineExceededError("no answer on the decode channel within the deadline");
      }
    }
  }
  lap.Mark(kWait);
  const uint32_t m = h.response_bytes.load(std::memory_order_relaxed);
  v1::AttentionDecodeStreamResponse r;
  if (m > h.capacity || !r.ParseFromArray(h.ResponseArea(), static_cast<int>(m))) {
    broken_ = true;
    return absl::InternalError("the decode channel's answer does not parse");
  }
  lap.Mark(kParse);
  if (r.error_code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(r.error_code()), r.error_message());
  }
  return std::move(*r.mutable_response());
}

absl::Status DecodeChannel::Close() {
  if (header_ == nullptr || id_ == 0) return absl::OkStatus();
  header_->Close();  // closed, then the doorbell
  broken_ = true;    // closed by us: later calls are FAILED_PRECONDITION
  const uint64_t id = id_;
  id_ = 0;
  absl::Status s = client_->CloseDecodeChannel(id);
  // NOT_FOUND: the daemon already ended it (the flag above, or its lease).
  return s.code() == absl::StatusCode::kNotFound ? absl::OkStatus() : s;
}

}  // namespace kvcd
