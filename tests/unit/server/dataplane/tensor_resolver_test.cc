// TensorResolver on a backend without a device: inline bytes are used where they are,
// device payloads are refused with FAILED_PRECONDITION naming the field, and a payload kind
// the field does not accept is INVALID_ARGUMENT naming what it accepts.
#include "server/dataplane/tensor_resolver.h"

#include <gtest/gtest.h>

namespace kvcd {
namespace {

TEST(TensorResolverTest, InlineBytesStayWhereTheyAreAndDevicePayloadsNeedADevice) {
  auto backend = MakeCpuBackend(1);
  BufferRegistry buffers(backend.get());
  TensorResolver r(backend.get(), &buffers);
  v1::TensorRef t;
  t.set_inline_data("abcd");
  ASSERT_TRUE(r.CheckPayload(t, "k", TensorResolver::kInline | TensorResolver::kIpc).ok());
  auto b = r.Input(t, "k");
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->on_device);
  EXPECT_EQ(b->data, t.inline_data().data());
  std::string staging;
  EXPECT_EQ(*r.HostInput(t, "k", &staging), t.inline_data().data());

  v1::TensorRef ipc;
  ipc.mutable_cuda_ipc()->set_buffer_id(1);
  absl::Status s = r.CheckPayload(ipc, "k", TensorResolver::kInline | TensorResolver::kIpc);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("k: CUDA IPC and NCCL payloads need a daemon with backend: cuda"),
            absl::string_view::npos)
      << s;
  s = r.CheckPayload(t, "destination", TensorResolver::kIpc | TensorResolver::kNccl);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expected cuda_ipc or nccl"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace kvcd
