#include "server/cluster/device_page_pull.h"

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#ifdef KVCD_HAVE_CUDA_BACKEND
#include "kvcd/kernels/cuda_nccl.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "server/formats/kernel_status.h"
#endif

namespace kvcd {

#ifdef KVCD_HAVE_CUDA_BACKEND
namespace {

namespace kc = kernels::cuda;

// A refused call to the peer: its code (a transport failure is UNAVAILABLE), naming the call.
absl::Status PeerCallError(const grpc::Status& s, const char* call) {
  const absl::StatusCode code = static_cast<absl::StatusCode>(s.error_code());
  return absl::Status(
      code == absl::StatusCode::kDeadlineExceeded ? absl::StatusCode::kUnavailable : code,
      absl::StrCat("peer ", call, ": ", s.error_message()));
}

// The sum of the chunks' bytes, within kMaxPullBytes.
absl::StatusOr<int64_t> TotalBytes(const DevicePagePull::Request& req) {
  int64_t total = 0;
  for (const DevicePagePull::Chunk& c : req.chunks) {
    if (c.bytes <= 0 || c.num_tokens <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("a chunk of ", c.num_tokens, " tokens and ",
                                                     c.bytes, " bytes, expected both positive"));
    }
    total += c.bytes;
    if (total > DevicePagePull::kMaxPullBytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("the pull's pages take more than ", DevicePagePull::kMaxPullBytes,
                       " bytes, the most a device transfer stages"));
    }
  }
  if (total == 0) return absl::InvalidArgumentError("the pull has no chunk");
  return total;
}

// Owns the device staging of one pull.
class Staging {
 public:
  ~Staging() {
    if (ptr_ != nullptr) (void)kc::Free(ptr_);
  }
  absl::Status Allocate(int64_t bytes) {
    return KernelStatus(kc::Malloc(&ptr_, static_cast<size_t>(bytes)),
                        absl::StatusCode::kResourceExhausted,
                        absl::StrCat("cannot allocate ", bytes, " bytes of device staging"));
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

void SetDestination(v1::FetchPagesRequest* f, int64_t bytes) {
  v1::TensorRef* d = f->mutable_destination();
  d->set_dtype(v1::DTYPE_U8);
  d->add_shape(bytes);
}

}  // namespace

absl::Status DevicePagePull::ByCudaIpc(const Request& req, bool* stored) {
  *stored = false;
  absl::StatusOr<int64_t> total = TotalBytes(req);
  if (!total.ok()) return total.status();
  Staging staging;
  if (absl::Status s = staging.Allocate(*total); !s.ok()) return s;
  std::string handle;
  if (absl::Status s = KernelStatus(kc::IpcExportMemory(staging.data(), &handle),
                                    absl::StatusCode::kFailedPrecondition,
                                    "cannot export the staging for CUDA IPC");
      !s.ok()) {
    return s;
  }
  v1::RegisterBufferRequest reg;
  reg.set_ipc_handle(handle);
  reg.set_size(static_cast<uint64_t>(*total));
  reg.set_lease_ms(req.lease_ms);
  reg.set_name(req.name);
  v1::RegisterBufferResponse registered;
  {
    grpc::ClientContext ctx;
    req.context(&ctx);
    const grpc::Status s = req.peer->RegisterBuffer(&ctx, reg, &registered);
    if (!s.ok()) return PeerCallError(s, "RegisterBuffer");
  }
  void* done = nullptr;
  absl::Status status =
      KernelStatus(kc::IpcOpenEvent(registered.done_event_handle(), &done),
                   absl::StatusCode::kFailedPrecondition, "cannot open the peer's done event");
  // One FetchPages for every chunk, each into its place in the staging (the peer checks the
  // region's size against the pages it holds).
  int64_t offset = 0;
  for (const Chunk& c : req.chunks) {
    if (!status.ok()) break;
    v1::FetchPagesRequest f;
    f.set_sequence_id(req.sequence_id);
    f.set_first_token(c.first_token);
    f.set_num_tokens(c.num_tokens);
    f.set_expand_to_bf16(false);
    SetDestination(&f, c.bytes);
    v1::CudaIpcRegion* r = f.mutable_destination()->mutable_cuda_ipc();
    r->set_buffer_id(registered.buffer_id());
    r->set_offset(static_cast<uint64_t>(offset));
    r->set_size(static_cast<uint64_t>(c.bytes));
    v1::FetchPagesResponse pages;
    grpc::ClientContext ctx;
    req.context(&ctx);
    const grpc::Status s = req.peer->FetchPages(&ctx, f, &pages);
    status = s.ok() ? req.check(c, pages) : PeerCallError(s, "FetchPages");
    offset += c.bytes;
  }
  // The peer's copies are done once its done event (recorded after them) completes.
  if (status.ok()) {
    status = KernelStatus(kc::EventSynchronize(done), absl::StatusCode::kInternal,
                          "waiting for the peer's copies");
  }
  if (done != nullptr) (void)kc::DestroyEvent(done);
  {
    v1::UnregisterBufferRequest un;
    un.set_buffer_id(registered.buffer_id());
    v1::UnregisterBufferResponse unregistered;
    grpc::ClientContext ctx;
    req.context(&ctx);
    (void)req.peer->UnregisterBuffer(&ctx, un, &unregistered);  // else its lease ends it
  }
  if (!status.ok()) return status;
  *stored = true;
  return req.store(staging.data(), *total);
}

absl::Status DevicePagePull::ByNccl(const Request& req, bool* stored) {
  *stored = false;
  absl::StatusOr<int64_t> total = TotalBytes(req);
  if (!total.ok()) return total.status();
  for (const Chunk& c : req.chunks) {
    if (c.bytes > kMaxNcclChunkBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("an NCCL chunk of ", c.bytes, " bytes, at most ", kMaxNcclChunkBytes));
    }
  }
  if (absl::Status s = KernelStatus(kc::NcclLoad(), absl::StatusCode::kFailedPrecondition,
                                    "NCCL is not available to the daemon");
      !s.ok()) {
    return s;
  }
  Staging staging;
  if (absl::Status s = staging.Allocate(*total); !s.ok()) return s;
  v1::NcclConnectRequest connect;
  connect.set_name(req.name);
  connect.set_timeout_ms(req.timeout_ms);
  v1::NcclConnectResponse connected;
  {
    grpc::ClientContext ctx;
    req.context(&ctx);
    const grpc::Status s = req.peer->NcclConnect(&ctx, connect, &connected);
    if (!s.ok()) return PeerCallError(s, "NcclConnect");
  }
  void* comm = nullptr;
  void* stream = nullptr;
  absl::Status status;
  if (connected.unique_id().size() != kc::kNcclUniqueIdBytes) {
    status = absl::InvalidArgumentError(absl::StrCat("peer NcclConnect answered a unique id of ",
                                                     connected.unique_id().size(),
                                                     " bytes, expected ", kc::kNcclUniqueIdBytes));
  }
  if (status.ok()) {
    status = KernelStatus(kc::CreateStream(&stream), absl::StatusCode::kInternal,
                          "cannot create the transfer stream");
  }
  if (status.ok()) {
    status = KernelStatus(kc::NcclInit(connected.unique_id(), 2, 1, req.timeout_ms, &comm),
                          absl::StatusCode::kFailedPrecondition,
                          "joining the peer's NCCL communicator as rank 1");
    if (!status.ok()) comm = nullptr;  // aborted by the failing call
  }
  int64_t offset = 0;
  uint64_t transfer = 0;
  for (const Chunk& c : req.chunks) {
    if (!status.ok()) break;
    // The receive is queued first; the peer's send happens inside its FetchPages.
    kernels::Error e =
        kc::NcclRecv(comm, staging.data() + offset, static_cast<size_t>(c.bytes), 0, stream);
    if (!e.ok()) {
      status = KernelStatus(e, absl::StatusCode::kInternal, "ncclRecv");
      break;
    }
    v1::FetchPagesRequest f;
    f.set_sequence_id(req.sequence_id);
    f.set_first_token(c.first_token);
    f.set_num_tokens(c.num_tokens);
    f.set_expand_to_bf16(false);
    SetDestination(&f, c.bytes);
    v1::NcclSlot* slot = f.mutable_destination()->mutable_nccl();
    slot->set_communicator_id(connected.communicator_id());
    slot->set_transfer_id(++transfer);
    slot->set_size(static_cast<uint64_t>(c.bytes));
    v1::FetchPagesResponse pages;
    grpc::ClientContext ctx;
    req.context(&ctx);
    const grpc::Status s = req.peer->FetchPages(&ctx, f, &pages);
    // A refused call sent nothing: the queued receive cannot finish, and the short wait
    // aborts the communicator.
    e = kc::NcclWait(comm, stream, s.ok() ? req.timeout_ms : 1);
    if (!s.ok()) {
      status = PeerCallError(s, "FetchPages");
      comm = nullptr;
    } else if (!e.ok()) {
      status = KernelStatus(e, absl::StatusCode::kDeadlineExceeded,
                            absl::StrCat("NCCL receive of ", c.bytes, " bytes"));
      comm = nullptr;
    } else {
      status = req.check(c, pages);
    }
    offset += c.bytes;
  }
  if (comm != nullptr) (void)kc::NcclDestroy(comm);
  if (stream != nullptr) (void)kc::DestroyStream(stream);
  {
    v1::NcclDisconnectRequest dis;
    dis.set_communicator_id(connected.communicator_id());
    v1::NcclDisconnectResponse disconnected;
    grpc::ClientContext ctx;
    req.context(&ctx);
    (void)req.peer->NcclDisconnect(&ctx, dis, &disconnected);
  }
  if (!status.ok()) return status;
  *stored = true;
  return req.store(staging.data(), *total);
}

#else  // no CUDA in this build

absl::Status DevicePagePull::ByCudaIpc(const Request&, bool* stored) {
  *stored = false;
  return absl::FailedPreconditionError("this kvcd build has no CUDA support");
}
absl::Status DevicePagePull::ByNccl(const Request&, bool* stored) {
  *stored = false;
  return absl::FailedPreconditionError("this kvcd build has no CUDA/NCCL support");
}

#endif

}  // namespace kvcd
