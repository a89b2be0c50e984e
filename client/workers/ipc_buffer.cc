#include "client/workers/ipc_buffer.h"

#include "absl/strings/str_cat.h"
#include "kvcd/kernels/cuda_stream_memops.h"
#include "proto/tensor_ref.h"

namespace kvcd::workers {

absl::Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::StatusOr<std::unique_ptr<IpcBuffer>> IpcBuffer::Create(Client* client, uint64_t bytes,
                                                             const std::string& name,
                                                             int64_t lease_ms) {
  std::unique_ptr<IpcBuffer> b(new IpcBuffer());
  b->client_ = client;
  b->size_ = bytes;
  void* p = nullptr;
  if (auto s = CudaCheck(cudaMalloc(&p, bytes), "cudaMalloc"); !s.ok()) return s;
  b->data_ = static_cast<uint8_t*>(p);
  if (auto s = CudaCheck(
          cudaEventCreateWithFlags(&b->ready_, cudaEventDisableTiming | cudaEventInterprocess),
          "cudaEventCreateWithFlags");
      !s.ok())
    return s;
  cudaIpcMemHandle_t mem;
  cudaIpcEventHandle_t ev;
  if (auto s = CudaCheck(cudaIpcGetMemHandle(&mem, p), "cudaIpcGetMemHandle"); !s.ok()) return s;
  if (auto s = CudaCheck(cudaIpcGetEventHandle(&ev, b->ready_), "cudaIpcGetEventHandle"); !s.ok())
    return s;
  // The ready event must have been recorded once before the daemon waits on it.
  if (auto s = CudaCheck(cudaEventRecord(b->ready_, nullptr), "cudaEventRecord"); !s.ok()) return s;
  v1::RegisterBufferRequest req;
  req.set_ipc_handle(reinterpret_cast<const char*>(&mem), sizeof(mem));
  req.set_ready_event_handle(reinterpret_cast<const char*>(&ev), sizeof(ev));
  req.set_size(bytes);
  req.set_lease_ms(lease_ms);
  req.set_name(name);
  auto resp = client->RegisterBuffer(req);
  if (!resp.ok()) return resp.status();
  b->id_ = resp->buffer_id();
  b->registered_ = true;
  cudaIpcEventHandle_t done;
  if (resp->done_event_handle().size() != sizeof(done)) {
    return absl::InternalError("the daemon's done_event_handle has the wrong size");
  }
  std::memcpy(&done, resp->done_event_handle().data(), sizeof(done));
  if (auto s = CudaCheck(cudaIpcOpenEventHandle(&b->done_, done), "cudaIpcOpenEventHandle");
      !s.ok())
    return s;
  return b;
}

IpcBuffer::~IpcBuffer() {
  if (registered_) (void)Unregister();
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (data_ != nullptr) cudaFree(data_);
}

void IpcBuffer::Region(v1::TensorRef* t, v1::DType dtype, std::vector<int64_t> shape,
                       uint64_t offset) const {
  SetIpcTensor(t, dtype, std::move(shape), id_, offset);
}

absl::Status IpcBuffer::MarkReady(cudaStream_t stream) {
  return CudaCheck(cudaEventRecord(ready_, stream), "cudaEventRecord(ready)");
}

absl::Status IpcBuffer::WaitDone(cudaStream_t stream) {
  return CudaCheck(cudaStreamWaitEvent(stream, done_, 0), "cudaStreamWaitEvent(done)");
}

absl::Status IpcBuffer::UseSignalWords(uint64_t offset) {
  if (offset % 8 != 0 || offset > size_ || size_ - offset < 8) {
    return absl::InvalidArgumentError(absl::StrCat("signal words at offset ", offset,
                                                   ": expected a multiple of 8 with 8 bytes "
                                                   "inside the buffer of ",
                                                   size_, " bytes"));
  }
  if (!kernels::cuda::StreamMemopsAvailable()) {
    return absl::FailedPreconditionError(
        "the driver offers no stream memory operations (cuStreamWaitValue32)");
  }
  if (auto s = CudaCheck(cudaMemset(data_ + offset, 0, 8), "cudaMemset(signal words)"); !s.ok()) {
    return s;
  }
  signal_offset_ = offset;
  signals_ = true;
  return absl::OkStatus();
}

absl::Status IpcBuffer::SignalReady(cudaStream_t stream, uint32_t value) {
  if (!signals_) return absl::FailedPreconditionError("UseSignalWords was not called");
  const kernels::Error e = kernels::cuda::StreamWriteValue32(
      stream, reinterpret_cast<uint32_t*>(data_ + signal_offset_), value);
  if (e.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("writing the ready word: ", e.message()));
}

absl::Status IpcBuffer::WaitSignalDone(cudaStream_t stream, uint32_t value) {
  if (!signals_) return absl::FailedPreconditionError("UseSignalWords was not called");
  const kernels::Error e = kernels::cuda::StreamWaitValue32(
      stream, reinterpret_cast<const uint32_t*>(data_ + signal_offset_) + 1, value);
  if (e.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("waiting for the done word: ", e.message()));
}

absl::Status IpcBuffer::WaitReadyOnHost() {
  return CudaCheck(cudaEventSynchronize(ready_), "cudaEventSynchronize(ready)");
}

absl::Status IpcBuffer::WaitDoneOnHost() {
  return CudaCheck(cudaEventSynchronize(done_), "cudaEventSynchronize(done)");
}

absl::Status IpcBuffer::Unregister() {
  if (!registered_) return absl::OkStatus();
  registered_ = false;
  return client_->UnregisterBuffer(id_);
}

}  // namespace kvcd::workers
