#include "server/backends/cuda_side_stream.h"

#include "kvcd/kernels/cuda_runtime_api.h"

namespace kvcd {

namespace kc = kernels::cuda;

kernels::Error CudaSideStream::Fork(bool rows) {
  if (stream_ == nullptr) {
    void *s = nullptr, *fork = nullptr, *join = nullptr;
    if (kernels::Error e = kc::CreateEvent(&fork); !e.ok()) return e;
    if (kernels::Error e = kc::CreateEvent(&join); !e.ok()) return e;
    if (kernels::Error e = kc::CreateSideStream(&s); !e.ok()) return e;
    stream_ = s;
    fork_event_ = fork;
    join_event_ = join;
  }
  if (kernels::Error e = kc::ForkTo(stream_, fork_event_); !e.ok()) return e;
  if (rows) rows_pending_ = true;
  return kernels::Error();
}

kernels::Error CudaSideStream::Join() {
  rows_pending_ = false;
  return kc::JoinFrom(stream_, join_event_);
}

kernels::Error CudaSideStream::JoinPendingRows() {
  return rows_pending_ ? Join() : kernels::Error();
}

}  // namespace kvcd
