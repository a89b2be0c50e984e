#include "server/dataplane/decode_channels.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/decode_channel_layout.h"
#include "common/log.h"
#include "common/phase_times.h"
#include "common/quote.h"
#include "common/random_id.h"
#include "kvcd/kernels/call_counts.h"
#include "server/dataplane/guarded_memory.h"

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

// The daemon's side of one channel request, step by step (PhaseTimes; off unless
// KVCD_PHASE_TIMES=1), and the CUDA work it enqueued.
struct ServePhases {
  int read = PhaseTimes::Phase("daemon.channel.read+parse");
  int check = PhaseTimes::Phase("daemon.channel.check (auth)");
  int decode = PhaseTimes::Phase("daemon.channel.decode (engine)");
  int write = PhaseTimes::Phase("daemon.channel.serialize+write");
  int total = PhaseTimes::Phase("daemon.channel.total (seen->answered)");
  int launches = PhaseTimes::Phase("#daemon.kernel launches");
  int h2d = PhaseTimes::Phase("#daemon.H2D copies");
  int d2h = PhaseTimes::Phase("#daemon.D2H copies");
  int records = PhaseTimes::Phase("#daemon.event records");
  int waits = PhaseTimes::Phase("#daemon.stream waits");
  int syncs = PhaseTimes::Phase("#daemon.host syncs");
};

struct CountSnapshot {
  uint64_t launches, h2d, d2h, records, waits, syncs;
  static CountSnapshot Take() {
    const kernels::CallCounts& c = kernels::Counts();
    return {c.launches.load(std::memory_order_relaxed),
            c.h2d.load(std::memory_order_relaxed),
            c.d2h.load(std::memory_order_relaxed),
            c.event_records.load(std::memory_order_relaxed),
            c.stream_waits.load(std::memory_order_relaxed),
            c.host_syncs.load(std::memory_order_relaxed)};
  }
};

inline void CpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// The longest one sleep on the doorbell lasts: the thread then looks at its stop flag and
// its lease again. A worker that rewrites the doorbell under the daemon (so that the
// daemon's own wake-up on Close finds the word unchanged) delays its own channel's end by
// at most this; an idle channel wakes a few times a second for it.
constexpr std::chrono::milliseconds kMaxSleep{200};

}  // namespace

// Everything read from the mapping is client-controlled and may change or vanish at any
// moment: the serving thread reads each field once into a local, validates it against
// what was fixed at Open (capacity, mapping size), and touches the mapping only through
// guarded copies (guarded_memory.h), so a rewritten field gets an error answer and a
// truncated object ends that channel alone.
struct DecodeChannels::Channel {
  uint64_t id = 0;
  // The shared-memory object's identity (st_dev, st_ino): one channel per object.
  dev_t dev = 0;
  ino_t ino = 0;
  DecodeChannelHeader* header = nullptr;
  size_t bytes = 0;       // mapped bytes: TotalBytes(capacity), fixed at Open
  uint32_t capacity = 0;  // the capacity validated at Open; the header's copy is never reused
  int64_t lease_ms = 0;
  std::unique_ptr<DecodeAdmission> admission;  // asked before every request (may be null)
  // request_seq when the channel was opened (the worker is still waiting for the
  // OpenDecodeChannel answer then): the serving thread may start after the first request.
  uint64_t opened_seq = 0;
  std::atomic<bool> stop{false};
  std::atomic<bool> done{false};
  std::thread thread;

  uint8_t* request_area() const {
    return reinterpret_cast<uint8_t*>(header) + DecodeChannelHeader::kAreasOffset;
  }
  uint8_t* response_area() const { return request_area() + capacity; }

  // Guarded loads and stores of the header's atomics; false if the mapping faulted.
  template <typename T>
  bool Load(const std::atomic<T>& a, T* out, std::memory_order order) const {
    struct Args {
      const std::atomic<T>* a;
      T* out;
      std::memory_order order;
    } args{&a, out, order};
    return RunGuarded(
        header, bytes,
        [](void* p) {
          auto* x = static_cast<Args*>(p);
          *x->out = x->a->load(x->order);
        },
        &args);
  }
  template <typename T>
  bool Store(std::atomic<T>& a, T value, std::memory_order order) const {
    struct Args {
      std::atomic<T>* a;
      T value;
      std::memory_order order;
    } args{&a, value, order};
    return RunGuarded(
        header, bytes,
        [](void* p) {
          auto* x = static_cast<Args*>(p);
          x->a->store(x->value, x->order);
        },
        &args);
  }

  // Stops the serving thread, waking it from the doorbell: stop, then a bump of the
  // channel's own doorbell (the thread re-reads stop after reading the bell, so either it
  // sees stop or its FUTEX_WAIT finds the word changed), then FUTEX_WAKE. Only on a
  // channel that still serves the region (started, not ended).
  void Stop() {
    stop.store(true, std::memory_order_seq_cst);
    if (!thread.joinable() || done.load()) return;
    struct Args {
      std::atomic<uint32_t>* bell;
    } args{&header->doorbell};
    (void)RunGuarded(
        header, bytes,
        [](void* p) {
          auto* a = static_cast<Args*>(p);
          a->bell->fetch_add(1, std::memory_order_seq_cst);
          DecodeChannelHeader::WakeAll(a->bell);
        },
        &args);
  }

  // Writes nothing into the region beyond Stop's doorbell: the serving thread sets `closed`
  // when it ends, and a channel whose thread never started (a refused open) never served
  // the region and is not touched at all.
  ~Channel() {
    Stop();
    if (thread.joinable()) thread.join();
    if (header != nullptr) munmap(header, bytes);
  }
};

DecodeChannels::DecodeChannels(DecodeEngine* engine, Options options)
    : engine_(engine), options_(options) {}

DecodeChannels::~DecodeChannels() { CloseAll(); }

absl::StatusOr<uint64_t> DecodeChannels::Open(const std::string& name, int64_t lease_ms,
                                              std::unique_ptr<DecodeAdmission> admission) {
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_name is ", Quote(name),
                     ", expected \"/kvcd-\" followed by [A-Za-z0-9._-], at most 128 bytes in all"));
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
  // The fixed header fields are read with pread (a short read, never a fault), validated,
  // and only then is exactly TotalBytes(capacity) mapped: the mapping's size is the
  // daemon's decision, whatever size the object claims or later takes.
  struct {
    uint64_t magic;
    uint32_t version;
    uint32_t capacity;
  } fixed{};
  static_assert(sizeof(fixed) == 16, "magic, version, capacity lead the header");
  struct stat st {};
  const bool have_size = fstat(fd, &st) == 0;
  const ssize_t got = pread(fd, &fixed, sizeof(fixed), 0);
  if (!have_size || got != static_cast<ssize_t>(sizeof(fixed)) ||
      fixed.magic != DecodeChannelHeader::kMagic ||
      fixed.version != DecodeChannelHeader::kVersion ||
      fixed.capacity < DecodeChannelHeader::kMinCapacity ||
      fixed.capacity > DecodeChannelHeader::kMaxCapacity ||
      static_cast<uint64_t>(st.st_size) < DecodeChannelHeader::TotalBytes(fixed.capacity)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory ", name, " is not a decode channel of version ",
        DecodeChannelHeader::kVersion, " (magic, version, or capacity ", fixed.capacity,
        " does not fit its ", have_size ? static_cast<int64_t>(st.st_size) : -1,
        " bytes; capacity must be ", DecodeChannelHeader::kMinCapacity, "..",
        DecodeChannelHeader::kMaxCapacity, "); see common/decode_channel_layout.h"));
  }
  {
    // One channel per object, whoever opened the first (and under whatever name): a second
    // thread would answer the first one's requests and end by marking the region closed.
    // Checked again, under the lock, before the channel starts.
    std::lock_guard<std::mutex> lock(mu_);
    ReapLocked();
    if (ServedLocked(st.st_dev, st.st_ino)) {
      close(fd);
      return AlreadyServed(name);
    }
  }
  const size_t bytes = DecodeChannelHeader::TotalBytes(fixed.capacity);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot map ", name, ": ", std::strerror(errno)));
  }
  auto c = std::make_unique<Channel>();
  c->dev = st.st_dev;
  c->ino = st.st_ino;
  c->header = static_cast<DecodeChannelHeader*>(p);
  c->bytes = bytes;
  c->capacity = fixed.capacity;
  c->lease_ms = lease_ms;
  c->admission = std::move(admission);
  if (!c->Load(c->header->request_seq, &c->opened_seq, std::memory_order_acquire)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory ", name, " shrank while the channel was opened"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  ReapLocked();
  if (ServedLocked(c->dev, c->ino)) return AlreadyServed(name);
  if (static_cast<int>(channels_.size()) >= options_.max_channels) {
    return absl::ResourceExhaustedError(
        absl::StrCat(options_.max_channels, " decode channels are open; close some first"));
  }
  do {
    c->id = RandomId64();
  } while (channels_.count(c->id));
  // The phase report a channel prints when it ends covers its lifetime (benches run one
  // channel at a time).
  if (PhaseTimes::Enabled()) PhaseTimes::Reset();
  Channel* raw = c.get();
  c->thread = std::thread([this, raw] { Serve(raw); });
  const uint64_t id = c->id;
  channels_.emplace(id, std::move(c));
  return id;
}

void DecodeChannels::Serve(Channel* c) {
  pthread_setname_np(pthread_self(), "kvcd-channel");  // top, /proc/<pid>/task/*/comm
  DecodeChannelHeader& h = *c->header;
  uint64_t seen = c->opened_seq;
  auto last_request = Clock::now();
  v1::AttentionDecodeRequest req;
  v1::AttentionDecodeStreamResponse resp;
  std::string in, out;
  static const ServePhases phases;
  bool faulted = false;
  while (!c->stop.load(std::memory_order_relaxed)) {
    uint64_t seq = 0;
    if (!c->Load(h.request_seq, &seq, std::memory_order_acquire)) {
      faulted = true;
      break;
    }
    if (seq == seen) {
      uint32_t closed = 0;
      if (!c->Load(h.closed, &closed, std::memory_order_acquire)) {
        faulted = true;
        break;
      }
      if (closed != 0) break;
      const auto idle = Clock::now() - last_request;
      const auto lease = std::chrono::milliseconds(c->lease_ms);
      if (idle > lease) break;
      if (idle < std::chrono::microseconds(options_.spin_us)) {
        for (int i = 0; i < 64; ++i) CpuRelax();
        continue;
      }
      // Past the spin window: sleep on the doorbell until the worker rings it, the
      // channel is stopped, or the lease (or kMaxSleep) passes.
      const auto sleep = std::min<Clock::duration>(lease - idle, kMaxSleep);
      if (!Sleep(c, seen, sleep)) {
        faulted = true;
        break;
      }
      continue;
    }
    seen = seq;
    last_request = Clock::now();
    PhaseLap lap, whole;
    const CountSnapshot counts_before = lap.on() ? CountSnapshot::Take() : CountSnapshot{};
    resp.Clear();
    uint32_t n = 0;  // read once; validated against the capacity fixed at Open
    if (!c->Load(h.request_bytes, &n, std::memory_order_relaxed)) {
      faulted = true;
      break;
    }
    absl::Status s;
    if (n > c->capacity) {
      s = absl::InvalidArgumentError(absl::StrCat("decode channel request_bytes is ", n,
                                                  ", more than the channel's capacity ",
                                                  c->capacity, " (fixed when it was opened)"));
    } else {
      // A private copy: the worker may rewrite the area while the daemon parses it.
      in.resize(n);
      if (!CopyGuarded(in.data(), c->request_area(), n, c->header, c->bytes)) {
        faulted = true;
        break;
      }
      if (!req.ParseFromString(in)) {
        s = absl::InvalidArgumentError(absl::StrCat("decode channel request of ", n,
                                                    " bytes is not an AttentionDecodeRequest"));
      } else {
        lap.Mark(phases.read);
        absl::StatusOr<std::vector<std::shared_ptr<Sequence>>> found =
            c->admission ? c->admission->Admit(req) : std::vector<std::shared_ptr<Sequence>>{};
        lap.Mark(phases.check);
        if (!found.ok()) {
          s = found.status();
        } else {
          const auto t0 = Clock::now();
          DecodeEngine::DeviceSignal signal;
          if (!c->Load(h.signal_buffer, &signal.buffer_id, std::memory_order_relaxed) ||
              !c->Load(h.signal_offset, &signal.offset, std::memory_order_relaxed)) {
            faulted = true;
            break;
          }
          signal.value = static_cast<uint32_t>(seq);
          s = signal.buffer_id == 0
                  ? engine_->AttentionDecode(req, resp.mutable_response(), *found)
                  : engine_->AttentionDecodeSignaled(req, resp.mutable_response(), *found, signal);
          if (c->admission) {
            c->admission->Answered(s, std::chrono::duration<double>(Clock::now() - t0).count(),
                                   resp.response());
          }
        }
        lap.Mark(phases.decode);
        resp.set_request_id(req.request_id());
      }
    }
    if (!s.ok()) {
      resp.clear_response();
      resp.set_error_code(static_cast<int>(s.code()));
      resp.set_error_message(std::string(s.message()));
    }
    out.clear();
    resp.SerializeToString(&out);
    if (out.size() > c->capacity) {
      resp.Clear();
      resp.set_request_id(req.request_id());
      resp.set_error_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
      resp.set_error_message(absl::StrCat("the response has ", out.size(),
                                          " bytes, more than the channel's capacity ", c->capacity,
                                          "; open a larger channel or write o_out to CUDA IPC"));
      out.clear();
      resp.SerializeToString(&out);
    }
    if (!CopyGuarded(c->response_area(), out.data(), out.size(), c->header, c->bytes) ||
        !c->Store(h.response_bytes, static_cast<uint32_t>(out.size()), std::memory_order_relaxed) ||
        !c->Store(h.response_seq, seq, std::memory_order_release)) {
      faulted = true;
      break;
    }
    if (lap.on()) {
      lap.Mark(phases.write);
      whole.Mark(phases.total);
      const CountSnapshot after = CountSnapshot::Take();
      PhaseTimes::Add(phases.launches,
                      static_cast<int64_t>(after.launches - counts_before.launches));
      PhaseTimes::Add(phases.h2d, static_cast<int64_t>(after.h2d - counts_before.h2d));
      PhaseTimes::Add(phases.d2h, static_cast<int64_t>(after.d2h - counts_before.d2h));
      PhaseTimes::Add(phases.records, static_cast<int64_t>(after.records - counts_before.records));
      PhaseTimes::Add(phases.waits, static_cast<int64_t>(after.waits - counts_before.waits));
      PhaseTimes::Add(phases.syncs, static_cast<int64_t>(after.syncs - counts_before.syncs));
    }
    served_.fetch_add(1, std::memory_order_relaxed);
  }
  if (faulted) {
    KVCD_LOG(WARNING) << "decode channel " << c->id
                      << ": its shared memory shrank under the mapping (SIGBUS caught); "
                         "channel closed";
  }
  // Tell the worker (a guarded store: when the header page is gone too, nothing to tell).
  (void)c->Store(h.closed, 1u, std::memory_order_release);
  if (c->admission) c->admission->Ended();
  if (PhaseTimes::Enabled()) {  // the channel's timeline (one worker at a time in benches)
    const std::string report =
        PhaseTimes::Report(absl::StrCat("decode channel ", c->id, " (daemon side)"));
    std::fprintf(stderr, "%s", report.c_str());
    PhaseTimes::Reset();
  }
  c->done.store(true);
}

bool DecodeChannels::Sleep(Channel* c, uint64_t seen, Clock::duration timeout) {
  DecodeChannelHeader& h = *c->header;
  uint32_t bell = 0, closed = 0;
  uint64_t seq = 0;
  if (!c->Load(h.doorbell, &bell, std::memory_order_seq_cst) ||
      !c->Store(h.daemon_waiting, 1u, std::memory_order_seq_cst) ||
      !c->Load(h.request_seq, &seq, std::memory_order_seq_cst) ||
      !c->Load(h.closed, &closed, std::memory_order_seq_cst)) {
    return false;
  }
  if (seq == seen && closed == 0 && !c->stop.load(std::memory_order_seq_cst)) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
    struct timespec ts {};
    ts.tv_sec = static_cast<time_t>(ns / 1000000000);
    ts.tv_nsec = static_cast<long>(ns % 1000000000);
    // Not FUTEX_PRIVATE_FLAG: the word is in a mapping shared with the worker's process.
    // EAGAIN (the bell rang since it was read), EINTR and ETIMEDOUT all mean: look again.
    const long r = syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h.doorbell), FUTEX_WAIT, bell,
                           &ts, nullptr, 0);
    if (r != 0 && errno == EFAULT) return false;  // the header page is gone
  }
  return c->Store(h.daemon_waiting, 0u, std::memory_order_seq_cst);
}

void DecodeChannels::ReapLocked() {
  // Channels that ended on their own (their thread set `closed` and stopped touching the
  // region): only the mapping is left to release.
  for (auto it = channels_.begin(); it != channels_.end();) {
    it = it->second->done.load() ? channels_.erase(it) : std::next(it);
  }
}

bool DecodeChannels::ServedLocked(dev_t dev, ino_t ino) const {
  for (const auto& [id, c] : channels_) {
    if (c->dev == dev && c->ino == ino) return true;
  }
  return false;
}

absl::Status DecodeChannels::AlreadyServed(const std::string& name) {
  // Says nothing about the channel that serves it (it may be another tenant's).
  return absl::AlreadyExistsError(absl::StrCat(
      "shared memory ", name,
      " is already served by an open decode channel; a region serves one channel: create a "
      "new shared-memory object for a new channel"));
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
  for (auto& [id, c] : all) c->Stop();  // every thread wakes at once; then each is joined
}

int64_t DecodeChannels::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [id, c] : channels_) n += c->done.load() ? 0 : 1;
  return n;
}

}  // namespace kvcd
