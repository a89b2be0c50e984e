#include "server/dataplane/nccl_links.h"

#include <chrono>
#include <condition_variable>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/random_id.h"
#include "common/status_macros.h"
#include "server/backends/device_runtime.h"

#ifdef KVCD_HAVE_CUDA_BACKEND
#include "kvcd/kernels/cuda_nccl.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "server/formats/kernel_status.h"
#endif

namespace kvcd {

#ifdef KVCD_HAVE_CUDA_BACKEND
namespace kc = kernels::cuda;
#endif

struct NcclLinks::Link {
  uint64_t id = 0;
  std::string name;
  int timeout_ms = 10000;
  std::thread joiner;

  std::mutex state_mu;
  std::condition_variable joined;
  enum class State { kJoining, kReady, kFailed } state ABSL_GUARDED_BY(state_mu) = State::kJoining;
  std::string error ABSL_GUARDED_BY(state_mu);

  std::mutex transfer_mu;  // one transfer at a time, in call order
  void* comm = nullptr;
  void* stream = nullptr;
  void* staging = nullptr;
  uint64_t staging_bytes = 0;

  ~Link() {
    if (joiner.joinable()) joiner.join();
#ifdef KVCD_HAVE_CUDA_BACKEND
    if (comm != nullptr) (void)kc::NcclDestroy(comm);
    if (staging != nullptr) (void)kc::Free(staging);
    if (stream != nullptr) (void)kc::DestroyStream(stream);
#endif
  }

  // Waits for the join; OK when the link can carry a transfer.
  absl::Status Ready() {
    std::unique_lock<std::mutex> lock(state_mu);
    joined.wait_for(lock, std::chrono::milliseconds(timeout_ms + 1000),
                    [&] { return state != State::kJoining; });
    if (state == State::kReady) return absl::OkStatus();
    if (state == State::kJoining) {
      return absl::DeadlineExceededError(
          absl::StrCat("NCCL communicator ", id,
                       " is still waiting for the worker to join (ncclCommInitRank "
                       "with rank 1)"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL communicator ", id, " failed: ", error, "; call NcclConnect again"));
  }
  void Fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(state_mu);
    state = State::kFailed;
    error = why;
    comm = nullptr;  // aborted by the failing call
  }
};

NcclLinks::NcclLinks(Backend* backend) : backend_(backend) {}
NcclLinks::~NcclLinks() = default;

int64_t NcclLinks::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(links_.size());
}

absl::StatusOr<std::shared_ptr<NcclLinks::Link>> NcclLinks::Find(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(id);
  if (it == links_.end()) {
    return absl::NotFoundError(absl::StrCat("NCCL communicator ", id,
                                            " does not exist (never connected, or disconnected); "
                                            "call NcclConnect"));
  }
  return it->second;
}

absl::Status NcclLinks::Disconnect(uint64_t id) {
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(id);
    if (it == links_.end()) {
      return absl::NotFoundError(absl::StrCat("NCCL communicator ", id, " does not exist"));
    }
    link = std::move(it->second);
    links_.erase(it);
  }
  std::lock_guard<std::mutex> transfer(link->transfer_mu);  // let a running transfer end
  return absl::OkStatus();
}

#ifdef KVCD_HAVE_CUDA_BACKEND

absl::StatusOr<NcclLinks::Connection> NcclLinks::Connect(const std::string& name,
                                                         int64_t timeout_ms) {
  if (absl::Status s = RequireDevice(*backend_).status(); !s.ok()) return s;
  if (timeout_ms < 0 || timeout_ms > 600000) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms is ", timeout_ms, ", expected 0 (10000) or 1..600000"));
  }
  if (name.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("name has ", name.size(), " bytes, expected at most 128"));
  }
  KVCD_RETURN_IF_ERROR(KernelStatus(kc::NcclLoad(), absl::StatusCode::kFailedPrecondition,
                                    "NCCL is not available to the daemon"));
  auto link = std::make_shared<Link>();
  link->name = name;
  link->timeout_ms = timeout_ms == 0 ? 10000 : static_cast<int>(timeout_ms);
  Connection c;
  KVCD_RETURN_IF_ERROR(KernelStatus(kc::NcclGetUniqueId(&c.unique_id), absl::StatusCode::kInternal,
                                    "ncclGetUniqueId"));
  KVCD_RETURN_IF_ERROR(KernelStatus(kc::CreateStream(&link->stream), absl::StatusCode::kInternal,
                                    "cannot create the transfer stream"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int>(links_.size()) >= kMaxLinks) {
      return absl::ResourceExhaustedError(
          absl::StrCat(kMaxLinks, " NCCL communicators are open; disconnect some first"));
    }
    do {
      c.id = RandomId64();
    } while (links_.count(c.id));
    link->id = c.id;
    links_.emplace(c.id, link);
  }
  Link* raw = link.get();
  const std::string uid = c.unique_id;
  link->joiner = std::thread([raw, uid] {
    void* comm = nullptr;
    const kernels::Error e = kc::NcclInit(uid, 2, 0, raw->timeout_ms, &comm);
    std::lock_guard<std::mutex> lock(raw->state_mu);
    if (e.ok()) {
      raw->comm = comm;
      raw->state = Link::State::kReady;
    } else {
      raw->state = Link::State::kFailed;
      raw->error = e.message();
      KVCD_LOG(ERROR) << "NCCL communicator " << raw->id << " (" << raw->name
                      << "): " << e.message();
    }
    raw->joined.notify_all();
  });
  return c;
}

namespace {
absl::Status Reserve(void** staging, uint64_t* have, uint64_t bytes) {
  if (bytes <= *have) return absl::OkStatus();
  if (*staging != nullptr) (void)kc::Free(*staging);
  *staging = nullptr;
  *have = 0;
  KVCD_RETURN_IF_ERROR(
      KernelStatus(kc::Malloc(staging, bytes), absl::StatusCode::kResourceExhausted,
                   absl::StrCat("cannot allocate ", bytes, " bytes of device staging")));
  *have = bytes;
  return absl::OkStatus();
}
}  // namespace

absl::Status NcclLinks::Receive(uint64_t id, uint64_t bytes,
                                const std::function<absl::Status(const uint8_t*)>& use) {
  auto link = Find(id);
  if (!link.ok()) return link.status();
  Link& l = **link;
  if (bytes == 0 || bytes > kMaxTransferBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL transfer of ", bytes, " bytes, expected 1..", kMaxTransferBytes));
  }
  std::lock_guard<std::mutex> transfer(l.transfer_mu);
  if (absl::Status s = l.Ready(); !s.ok()) return s;
  if (absl::Status s = Reserve(&l.staging, &l.staging_bytes, bytes); !s.ok()) return s;
  kernels::Error e = kc::NcclRecv(l.comm, l.staging, bytes, 1, l.stream);
  if (e.ok()) e = kc::NcclWait(l.comm, l.stream, l.timeout_ms);
  if (!e.ok()) {
    l.Fail(e.message());
    return KernelStatus(e, absl::StatusCode::kDeadlineExceeded,
                        absl::StrCat("NCCL receive of ", bytes, " bytes on communicator ", id),
                        "; nothing was stored");
  }
  return use(static_cast<const uint8_t*>(l.staging));
}

absl::Status NcclLinks::Send(uint64_t id, uint64_t bytes,
                             const std::function<absl::Status(uint8_t*)>& fill) {
  auto link = Find(id);
  if (!link.ok()) return link.status();
  Link& l = **link;
  if (bytes == 0 || bytes > kMaxTransferBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL transfer of ", bytes, " bytes, expected 1..", kMaxTransferBytes));
  }
  std::lock_guard<std::mutex> transfer(l.transfer_mu);
  if (absl::Status s = l.Ready(); !s.ok()) return s;
  if (absl::Status s = Reserve(&l.staging, &l.staging_bytes, bytes); !s.ok()) return s;
  if (absl::Status s = fill(static_cast<uint8_t*>(l.staging)); !s.ok()) return s;
  kernels::Error e = kc::SynchronizeDefaultStream();
  if (e.ok()) e = kc::NcclSend(l.comm, l.staging, bytes, 1, l.stream);
  if (e.ok()) e = kc::NcclWait(l.comm, l.stream, l.timeout_ms);
  if (!e.ok()) {
    l.Fail(e.message());
    return KernelStatus(e, absl::StatusCode::kDeadlineExceeded,
                        absl::StrCat("NCCL send of ", bytes, " bytes on communicator ", id));
  }
  return absl::OkStatus();
}

#else  // no CUDA in this build

absl::StatusOr<NcclLinks::Connection> NcclLinks::Connect(const std::string&, int64_t) {
  absl::Status s = RequireDevice(*backend_).status();
  if (!s.ok()) return s;
  return absl::FailedPreconditionError("this kvcd build has no CUDA/NCCL support");
}
absl::Status NcclLinks::Receive(uint64_t id, uint64_t,
                                const std::function<absl::Status(const uint8_t*)>&) {
  return Find(id).status();
}
absl::Status NcclLinks::Send(uint64_t id, uint64_t, const std::function<absl::Status(uint8_t*)>&) {
  return Find(id).status();
}

#endif

}  // namespace kvcd
