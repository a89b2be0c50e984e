#include "server/dataplane/decode_channels.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/decode_channel_layout.h"
#include "common/random_id.h"

namespace kvcd {
namespace {

using Clock = std::chrono::steady_clock;

bool ValidName(const std::string& n) {
  if (n.size() < 7 || n.size() > 128 || n.rfind("/kvcd-", 0) != 0) return false;
  for (size_t i = 1; i < n.size(); ++i) {
    const char c = n[i];
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'))
      return false;
  }
  return true;
}

inline void CpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

struct DecodeChannels::Channel {
  uint64_t id = 0;
  DecodeChannelHeader* header = nullptr;
  size_t bytes = 0;
  int64_t lease_ms = 0;
  CheckFn check;  // runs before every request of this channel (may be empty)
  // request_seq when the channel was opened (the worker is still waiting for the
  // OpenDecodeChannel answer then): the serving thread may start after the first request.
  uint64_t opened_seq = 0;
  std::atomic<bool> stop{false};
  std::atomic<bool> done{false};
  std::thread thread;
  ~Channel() {
    stop.store(true);
    if (thread.joinable()) thread.join();
    if (header != nullptr) {
      header->closed.store(1, std::memory_order_release);
      munmap(header, bytes);
    }
  }
};

DecodeChannels::DecodeChannels(DecodeFn decode, Options options)
    : decode_(std::move(decode)), options_(options) {}

DecodeChannels::~DecodeChannels() { CloseAll(); }

absl::StatusOr<uint64_t> DecodeChannels::Open(const std::string& name, int64_t lease_ms,
                                              CheckFn check) {
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_name is '", name.substr(0, 140),
        "', expected \"/kvcd-\" followed by [A-Za-z0-9._-], at most 128 bytes in all"));
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int e = errno;
    const std::string why = std::strerror(e);
    if (e == ENOENT) {
      return absl::NotFoundError(absl::StrCat(
          "shared memory ", name, " does not exist on the daemon's host (shm_open: ", why,
          "); the channel needs the same node"));
    }
    return absl::InvalidArgumentError(absl::StrCat("cannot open shared memory ", name, ": ", why));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(DecodeChannelHeader::TotalBytes(
                                              DecodeChannelHeader::kMinCapacity))) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory ", name, " has ", st.st_size, " bytes, expected at least ",
                     DecodeChannelHeader::TotalBytes(DecodeChannelHeader::kMinCapacity)));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot map ", name, ": ", std::strerror(errno)));
  }
  auto c = std::make_unique<Channel>();
  c->header = static_cast<DecodeChannelHeader*>(p);
  c->bytes = bytes;
  c->lease_ms = lease_ms;
  c->check = std::move(check);
  const DecodeChannelHeader& h = *c->header;
  if (h.magic != DecodeChannelHeader::kMagic || h.version != DecodeChannelHeader::kVersion ||
      h.capacity < DecodeChannelHeader::kMinCapacity ||
      h.capacity > DecodeChannelHeader::kMaxCapacity ||
      DecodeChannelHeader::TotalBytes(h.capacity) > bytes) {
    const std::string msg =
        absl::StrCat("shared memory ", name, " is not a decode channel of version ",
                     DecodeChannelHeader::kVersion, " (magic, version, or capacity ", h.capacity,
                     " does not fit its ", bytes, " bytes); see common/decode_channel_layout.h");
    munmap(p, bytes);
    c->header = nullptr;
    return absl::InvalidArgumentError(msg);
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Channels that ended on their own are reaped here.
  for (auto it = channels_.begin(); it != channels_.end();) {
    it = it->second->done.load() ? channels_.erase(it) : std::next(it);
  }
  if (static_cast<int>(channels_.size()) >= options_.max_channels) {
    return absl::ResourceExhaustedError(
        absl::StrCat(options_.max_channels, " decode channels are open; close some first"));
  }
  do {
    c->id = RandomId64();
  } while (channels_.count(c->id));
  c->opened_seq = c->header->request_seq.load(std::memory_order_acquire);
  Channel* raw = c.get();
  c->thread = std::thread([this, raw] { Serve(raw); });
  const uint64_t id = c->id;
  channels_.emplace(id, std::move(c));
  return id;
}

void DecodeChannels::Serve(Channel* c) {
  DecodeChannelHeader& h = *c->header;
  uint64_t seen = c->opened_seq;
  auto last_request = Clock::now();
  v1::AttentionDecodeRequest req;
  v1::AttentionDecodeStreamResponse resp;
  std::string out;
  while (!c->stop.load(std::memory_order_relaxed)) {
    const uint64_t seq = h.request_seq.load(std::memory_order_acquire);
    if (seq == seen) {
      if (h.closed.load(std::memory_order_acquire) != 0) break;
      const auto idle = Clock::now() - last_request;
      if (idle > std::chrono::milliseconds(c->lease_ms)) break;
      if (idle < std::chrono::microseconds(options_.spin_us)) {
        for (int i = 0; i < 64; ++i) CpuRelax();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(options_.poll_us));
      }
      continue;
    }
    seen = seq;
    last_request = Clock::now();
    resp.Clear();
    const uint32_t n = h.request_bytes.load(std::memory_order_relaxed);
    absl::Status s;
    if (n > h.capacity || !req.ParseFromArray(h.RequestArea(), static_cast<int>(n))) {
      s = absl::InvalidArgumentError(absl::StrCat(
          "decode channel request of ", n, " bytes is not an AttentionDecodeRequest within the ",
          h.capacity, "-byte area"));
    } else {
      if (c->check) s = c->check(req);
      if (s.ok()) s = decode_(req, resp.mutable_response());
      resp.set_request_id(req.request_id());
    }
    if (!s.ok()) {
      resp.clear_response();
      resp.set_error_code(static_cast<int>(s.code()));
      resp.set_error_message(std::string(s.message()));
    }
    out.clear();
    resp.SerializeToString(&out);
    if (out.size() > h.capacity) {
      resp.Clear();
      resp.set_request_id(req.request_id());
      resp.set_error_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
      resp.set_error_message(absl::StrCat("the response has ", out.size(),
                                          " bytes, more than the channel's capacity ", h.capacity,
                                          "; open a larger channel or write o_out to CUDA IPC"));
      out.clear();
      resp.SerializeToString(&out);
    }
    std::memcpy(h.ResponseArea(), out.data(), out.size());
    h.response_bytes.store(static_cast<uint32_t>(out.size()), std::memory_order_relaxed);
    h.response_seq.store(seq, std::memory_order_release);
    served_.fetch_add(1, std::memory_order_relaxed);
  }
  h.closed.store(1, std::memory_order_release);
  c->done.store(true);
}

absl::Status DecodeChannels::Close(uint64_t id) {
  std::unique_ptr<Channel> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = channels_.find(id);
    if (it == channels_.end() || it->second->done.load()) {
      if (it != channels_.end()) channels_.erase(it);
      return absl::NotFoundError(absl::StrCat(
          "decode channel ", id, " is not open (closed, idle past its lease, or never opened)"));
    }
    c = std::move(it->second);
    channels_.erase(it);
  }
  return absl::OkStatus();  // ~Channel stops and joins the thread
}

void DecodeChannels::CloseAll() {
  std::map<uint64_t, std::unique_ptr<Channel>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(channels_);
  }
}

int64_t DecodeChannels::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [id, c] : channels_) n += c->done.load() ? 0 : 1;
  return n;
}

}  // namespace kvcd
