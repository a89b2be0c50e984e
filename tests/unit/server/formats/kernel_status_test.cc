#include "server/formats/kernel_status.h"

#include <gtest/gtest.h>

namespace kvcd {
namespace kernel_status_test {

using kernels::Error;
using kernels::ErrorCode;

TEST(KernelStatusTest, OkErrorIsOkStatus) {
  EXPECT_TRUE(Error().ok());
  EXPECT_TRUE(KernelStatus(Error(), absl::StatusCode::kResourceExhausted, "alloc").ok());
  EXPECT_TRUE(CudaStatus(Error(), "upload").ok());
}

TEST(KernelStatusTest, FailureKeepsCodeContextAndText) {
  const Error e(ErrorCode::kCuda, "out of memory", 2);
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.device_code(), 2);
  const absl::Status s =
      KernelStatus(e, absl::StatusCode::kResourceExhausted, "cannot allocate 8 bytes");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "cannot allocate 8 bytes: out of memory");
  const absl::Status bare = KernelStatus(e, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bare.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bare.message(), "out of memory");
  const absl::Status after =
      KernelStatus(Error(ErrorCode::kNccl, "NCCL: timeout"), absl::StatusCode::kDeadlineExceeded,
                   "receive", "; nothing was stored");
  EXPECT_EQ(after.message(), "receive: NCCL: timeout; nothing was stored");
}

TEST(KernelStatusTest, CudaStatusIsInternalWithWhatFailed) {
  const absl::Status s = CudaStatus(Error(ErrorCode::kCuda, "invalid argument", 1), "page check");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "CUDA: page check: invalid argument");
}

}  // namespace kernel_status_test
}  // namespace kvcd
