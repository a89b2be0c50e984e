// TensorResolver on a backend without a device: one Resolve per tensor checks it against
// its spec (dtype, shape, payload kind) and says where its bytes are; inline bytes are used
// where they are, device payloads are refused with FAILED_PRECONDITION naming the field, and
// a payload kind the field does not accept is INVALID_ARGUMENT naming what it accepts. A
// group resolved together reports every shape before any payload.
#include "server/dataplane/tensor_resolver.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "proto/tensor_ref.h"

namespace kvcd {
namespace tensor_resolver_test {

TensorSpec Spec(absl::string_view field, std::vector<int64_t> shape, int kinds) {
  TensorSpec s;
  s.field = field;
  s.shape = std::move(shape);
  s.kinds = kinds;
  return s;
}

TEST(TensorResolverTest, InlineBytesStayWhereTheyAreAndDevicePayloadsNeedADevice) {
  auto backend = MakeCpuBackend(1);
  BufferRegistry buffers(backend.get());
  TensorResolver r(backend.get(), &buffers);
  const float values[2] = {1.0f, 2.0f};
  v1::TensorRef t;
  SetF32Tensor(&t, {2}, values);
  const TensorSpec input = Spec("k", {2}, TensorResolver::kInline | TensorResolver::kIpc);
  auto b = r.Resolve(t, input);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(b->on_device);
  EXPECT_EQ(b->data, t.inline_data().data());

  v1::TensorRef ipc = t;
  ipc.mutable_cuda_ipc()->set_buffer_id(1);
  ipc.mutable_cuda_ipc()->set_size(8);
  absl::Status s = r.Resolve(ipc, input).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("k: CUDA IPC and NCCL payloads need a daemon with backend: cuda"),
            absl::string_view::npos)
      << s;
  TensorSpec destination = Spec("destination", {2}, TensorResolver::kIpc | TensorResolver::kNccl);
  destination.dtypes = TensorSpec::DTypes::kF32;
  s = r.Resolve(t, destination).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expected cuda_ipc or nccl"), absl::string_view::npos) << s;
}

TEST(TensorResolverTest, ShapesAreCheckedBeforePayloadsAndHostBytesAreScanned) {
  auto backend = MakeCpuBackend(1);
  BufferRegistry buffers(backend.get());
  TensorResolver r(backend.get(), &buffers);
  const float values[2] = {1.0f, std::numeric_limits<float>::infinity()};
  v1::TensorRef k, v;
  SetF32Tensor(&k, {2}, values);
  SetF32Tensor(&v, {2}, values);
  k.mutable_cuda_ipc()->set_size(8);  // a device payload: refused on this backend ...
  v.add_shape(1);                     // ... but v's shape is reported first
  const TensorSpec ks = Spec("k", {2}, TensorResolver::kInline | TensorResolver::kIpc);
  TensorSpec vs = Spec("v", {2}, TensorResolver::kInline | TensorResolver::kIpc);
  TensorResolver::Bytes kb, vb;
  absl::Status s = r.ResolveAll({{&k, &ks, &kb}, {&v, &vs, &vb}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("v.shape is [2, 1], expected [2]"), absl::string_view::npos) << s;

  // V must share K's dtype when the spec says so.
  SetF32Tensor(&k, {2}, values);
  v1::TensorRef v16;
  const uint16_t halves[2] = {0x3f80, 0x4000};
  SetBf16Tensor(&v16, {2}, halves);
  vs.same_dtype_as = &k;
  vs.same_dtype_field = "k";
  s = r.ResolveAll({{&k, &ks, &kb}, {&v16, &vs, &vb}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("v.dtype is BF16, expected the dtype of k (F32)"),
            absl::string_view::npos)
      << s;

  // With scan_host, the Inf at flat index 1 is named.
  TensorSpec scanned = ks;
  scanned.scan_host = true;
  s = r.Resolve(k, scanned).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("k[1] (flat index of 2 F32 values) is +Inf"), absl::string_view::npos)
      << s;
  EXPECT_TRUE(r.Resolve(k, ks).ok());  // not scanned: the formats check as they store
}

TEST(TensorResolverTest, AShapeKnownOnlyAfterThePayloadIsAskedForThen) {
  auto backend = MakeCpuBackend(1);
  BufferRegistry buffers(backend.get());
  TensorResolver r(backend.get(), &buffers);
  v1::TensorRef t;
  t.set_dtype(v1::DTYPE_U8);
  t.add_shape(16);
  t.set_inline_data(std::string(16, '\0'));
  int asked = 0;
  TensorSpec spec = Spec("pages", {}, TensorResolver::kIpc | TensorResolver::kNccl);
  spec.dtypes = TensorSpec::DTypes::kU8;
  spec.shape_after_payload = [&]() -> absl::StatusOr<std::vector<int64_t>> {
    ++asked;
    return std::vector<int64_t>{16};
  };
  // The payload kind is refused before the shape is asked for.
  EXPECT_EQ(r.Resolve(t, spec).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(asked, 0);
  spec.kinds |= TensorResolver::kInline;
  EXPECT_TRUE(r.Resolve(t, spec).ok());
  EXPECT_EQ(asked, 1);
  spec.shape_after_payload = []() -> absl::StatusOr<std::vector<int64_t>> {
    return absl::InvalidArgumentError("the range holds no page");
  };
  absl::Status s = r.Resolve(t, spec).status();
  EXPECT_EQ(s.message(), "the range holds no page") << s;
}

}  // namespace tensor_resolver_test
}  // namespace kvcd
