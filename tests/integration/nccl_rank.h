// The test process as rank 1 of an NCCL link that a daemon opened (NcclConnect): the
// PushPages / FetchPages requests whose bytes travel over the communicator, and running
// such a call on a thread of its own while this thread sends or receives those bytes.
// Header-only test code of the CUDA tests (data_plane_test.cc, cuda_device_test.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "kvcd/kernels/cuda_nccl.h"
#include "kvcd/v1/kvcache.pb.h"

namespace kvcd::testing_util {

// `num_pages` pages of `put`'s tokens stored under `salt`, their `bytes` arriving over
// communicator `communicator_id`.
inline v1::PushPagesRequest NcclPush(const std::string& model, const std::string& salt,
                                     const v1::PutRequest& put, int64_t num_pages,
                                     uint64_t communicator_id, int64_t bytes) {
  v1::PushPagesRequest push;
  push.set_model(model);
  push.set_cache_salt(salt);
  *push.mutable_tokens() = put.tokens();
  push.set_num_pages(num_pages);
  push.mutable_pages()->set_dtype(v1::DTYPE_U8);
  push.mutable_pages()->add_shape(bytes);
  push.mutable_pages()->mutable_nccl()->set_communicator_id(communicator_id);
  push.mutable_pages()->mutable_nccl()->set_size(bytes);
  return push;
}

// Sequence `seq`'s stored pages, `bytes` of them, sent into communicator `communicator_id`.
inline v1::FetchPagesRequest NcclFetch(uint64_t seq, uint64_t communicator_id, int64_t bytes) {
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  f.mutable_destination()->set_dtype(v1::DTYPE_U8);
  f.mutable_destination()->add_shape(bytes);
  f.mutable_destination()->mutable_nccl()->set_communicator_id(communicator_id);
  f.mutable_destination()->mutable_nccl()->set_size(bytes);
  return f;
}

// Runs `call` (the RPC, rank 0's side) on a thread of its own while this thread, rank 1 of
// `comm`, sends (`send`) or receives the `bytes` at `dev` on `stream` and waits for them.
// With `init_error` set (rank 1 could not join), nothing is sent and the call still runs.
// Returns the NCCL error text: empty on success.
inline std::string NcclBeside(const std::function<void()>& call, bool send, void* comm,
                              uint8_t* dev, int64_t bytes, void* stream,
                              const std::string& init_error = "") {
  std::thread rpc(call);
  std::string error = init_error;
  if (error.empty()) {
    error = send ? kernels::cuda::NcclSend(comm, dev, bytes, 0, stream).message()
                 : kernels::cuda::NcclRecv(comm, dev, bytes, 0, stream).message();
  }
  if (error.empty()) error = kernels::cuda::NcclWait(comm, stream, 8000).message();
  rpc.join();
  return error;
}

}  // namespace kvcd::testing_util
