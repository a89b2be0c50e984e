#include "server/dataplane/buffer_registry.h"

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/random_id.h"
#include "common/status_macros.h"
#include "common/steady_clock.h"
#include "server/backends/device_runtime.h"

namespace kvcd {
namespace {

constexpr size_t kHandleBytes = 64;  // cudaIpcMemHandle_t / cudaIpcEventHandle_t

}  // namespace

BufferRegistry::Buffer::~Buffer() {
  // A signal wait whose worker died before writing its ready word would hold the daemon's
  // stream (and every other worker's calls) for ever: release it first.
  if (uint32_t* word = signal_word.load(); word != nullptr) {
    device->ReleaseValue(word, signal_value.load());
  }
  // Work queued on the mapping (an asynchronous attention output, a fetch) must finish
  // before the mapping goes away.
  (void)device->Synchronize();
  if (base != nullptr) device->CloseIpcBuffer(base);
  if (ready_event != nullptr) device->DestroyEvent(ready_event);
  if (done_event != nullptr) device->DestroyEvent(done_event);
}

BufferRegistry::BufferRegistry(Backend* backend) : backend_(backend) {}

absl::StatusOr<std::shared_ptr<BufferRegistry::Buffer>> BufferRegistry::Register(
    const v1::RegisterBufferRequest& req, int64_t lease_ms, int max_buffers,
    std::string* done_handle) {
  KVCD_ASSIGN_OR_RETURN(DeviceRuntime * device, RequireDevice(*backend_));
  if (req.ipc_handle().size() != kHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("ipc_handle has ", req.ipc_handle().size(),
                                                   " bytes, expected ", kHandleBytes,
                                                   " (a cudaIpcMemHandle_t)"));
  }
  if (!req.ready_event_handle().empty() && req.ready_event_handle().size() != kHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("ready_event_handle has ", req.ready_event_handle().size(),
                     " bytes, expected ", kHandleBytes, " (a cudaIpcEventHandle_t) or none"));
  }
  if (req.size() == 0 || req.size() > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size is ", req.size(), ", expected 1..2^40 bytes of the allocation"));
  }
  if (req.name().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("name has ", req.name().size(), " bytes, expected at most 128"));
  }
  if (size() >= max_buffers) {
    return absl::ResourceExhaustedError(
        absl::StrCat(max_buffers, " buffers are registered (max_buffers); unregister some first"));
  }
  auto buf = std::make_shared<Buffer>(device);
  buf->name = req.name();
  buf->size = req.size();
  auto base = device->OpenIpcBuffer(req.ipc_handle());
  if (!base.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_handle cannot be opened (", base.status().message(),
        "); expected the handle of a live cudaMalloc allocation of another process on the "
        "daemon's GPU"));
  }
  buf->base = static_cast<uint8_t*>(*base);
  if (!req.ready_event_handle().empty()) {
    auto ev = device->OpenIpcEvent(req.ready_event_handle());
    if (!ev.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ready_event_handle cannot be opened (", ev.status().message(),
          "); expected an event created with cudaEventInterprocess | cudaEventDisableTiming"));
    }
    buf->ready_event = *ev;
  }
  KVCD_ASSIGN_OR_RETURN(buf->done_event, device->CreateIpcEvent(done_handle));
  buf->lease_ms.store(lease_ms);
  buf->deadline_ns.store(SteadyNowNs() + lease_ms * 1000000);
  std::lock_guard<std::mutex> lock(mu_);
  do {
    buf->id = RandomId64();
  } while (buffers_.count(buf->id));
  buffers_.emplace(buf->id, buf);
  return buf;
}

absl::Status BufferRegistry::Unregister(uint64_t id) {
  std::shared_ptr<Buffer> buf;  // released outside the lock (its destructor synchronizes)
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = buffers_.find(id);
    if (it == buffers_.end()) {
      return absl::NotFoundError(absl::StrCat("buffer ", id, " is not registered"));
    }
    buf = std::move(it->second);
    buffers_.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<BufferRegistry::Buffer>> BufferRegistry::Find(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.find(id);
  if (it == buffers_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "buffer ", id,
        " is not registered (never registered, unregistered, its lease expired, or the daemon "
        "restarted); call RegisterBuffer again"));
  }
  return it->second;
}

absl::StatusOr<BufferRegistry::Region> BufferRegistry::Resolve(const v1::CudaIpcRegion& r,
                                                               absl::string_view field) {
  auto buf = Find(r.buffer_id());
  if (!buf.ok())
    return absl::Status(buf.status().code(), absl::StrCat(field, ": ", buf.status().message()));
  const auto end = CheckedAdd(static_cast<int64_t>(r.offset()), static_cast<int64_t>(r.size()));
  if (r.offset() > (uint64_t{1} << 62) || r.size() > (uint64_t{1} << 62) || !end ||
      static_cast<uint64_t>(*end) > (*buf)->size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".cuda_ipc covers bytes [", r.offset(), ", ", r.offset(), " + ",
                     r.size(), ") but buffer ", r.buffer_id(), " has ", (*buf)->size, " bytes"));
  }
  if (r.offset() % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".cuda_ipc.offset is ", r.offset(), ", expected a multiple of 16"));
  }
  (*buf)->deadline_ns.store(SteadyNowNs() + (*buf)->lease_ms.load() * 1000000);
  return Region{*buf, (*buf)->base + r.offset(), r.size()};
}

absl::Status BufferRegistry::WaitReady(const Region& r) {
  if (r.buffer->ready_event == nullptr) return absl::OkStatus();
  return r.buffer->device->WaitEvent(r.buffer->ready_event);
}

absl::Status BufferRegistry::MarkWritten(const Region& r) {
  return r.buffer->device->RecordEvent(r.buffer->done_event);
}

namespace {

absl::StatusOr<uint32_t*> SignalWord(const BufferRegistry::Region& r, uint64_t offset,
                                     uint64_t word) {
  const BufferRegistry::Buffer& b = *r.buffer;
  if (offset % 8 != 0 || offset > b.size || b.size - offset < 8) {
    return absl::InvalidArgumentError(absl::StrCat("decode channel signal_offset is ", offset,
                                                   ", expected a multiple of 8 with its 8 bytes "
                                                   "(ready word, done word) inside buffer ",
                                                   b.id, " of ", b.size, " bytes"));
  }
  return reinterpret_cast<uint32_t*>(b.base + offset) + word;
}

}  // namespace

absl::Status BufferRegistry::WaitSignal(const Region& r, uint64_t offset, uint32_t value) {
  KVCD_ASSIGN_OR_RETURN(uint32_t * ready, SignalWord(r, offset, 0));
  KVCD_RETURN_IF_ERROR(r.buffer->device->WaitValue(ready, value));
  r.buffer->signal_value.store(value);
  r.buffer->signal_word.store(ready);
  return absl::OkStatus();
}

absl::Status BufferRegistry::WriteSignal(const Region& r, uint64_t offset, uint32_t value) {
  KVCD_ASSIGN_OR_RETURN(uint32_t * done, SignalWord(r, offset, 1));
  return r.buffer->device->WriteValue(done, value);
}

int BufferRegistry::ExpireLeases(int64_t now_ns) {
  std::vector<std::shared_ptr<Buffer>> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = buffers_.begin(); it != buffers_.end();) {
      if (it->second->deadline_ns.load() < now_ns) {
        expired.push_back(std::move(it->second));
        it = buffers_.erase(it);
      } else {
        ++it;
      }
    }
  }
  return static_cast<int>(expired.size());
}

int64_t BufferRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(buffers_.size());
}

}  // namespace kvcd
