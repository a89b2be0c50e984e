#include "server/dataplane/tensor_resolver.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/finite_check.h"
#include "proto/tensor_ref.h"
#include "server/backends/device_runtime.h"

namespace kvcd {
namespace {

// The ready events this thread waited for inside its outermost CallScope.
struct CallWaits {
  int depth = 0;
  int n = 0;
  const void* events[8] = {};
};
thread_local CallWaits call_waits;

// This thread's SignalScope (active while one is alive).
struct CallSignal {
  bool active = false;
  uint64_t buffer_id = 0;
  uint64_t offset = 0;
  uint32_t value = 0;
  BufferRegistry::Region waited;  // the region whose buffer's ready word was waited on
  bool written = false;
};
thread_local CallSignal call_signal;

}  // namespace

TensorResolver::CallScope::CallScope() { ++call_waits.depth; }

TensorResolver::CallScope::~CallScope() {
  if (--call_waits.depth == 0) call_waits.n = 0;
}

TensorResolver::SignalScope::SignalScope(BufferRegistry* buffers, uint64_t buffer_id,
                                         uint64_t offset, uint32_t value)
    : buffers_(buffers) {
  call_signal = CallSignal{true, buffer_id, offset, value, {}, false};
}

TensorResolver::SignalScope::~SignalScope() {
  CallSignal& s = call_signal;
  if (s.waited.buffer != nullptr && !s.written) {
    (void)buffers_->WriteSignal(s.waited, s.offset, s.value);
  }
  s = CallSignal{};
}

absl::Status TensorResolver::MarkWritten(const BufferRegistry::Region& r) {
  CallSignal& s = call_signal;
  if (s.active && r.buffer->id == s.buffer_id) {
    if (s.written) return absl::OkStatus();
    KVCD_RETURN_IF_ERROR(buffers_->WriteSignal(r, s.offset, s.value));
    s.written = true;
    return absl::OkStatus();
  }
  return buffers_->MarkWritten(r);
}

absl::Status TensorResolver::WaitReadyOnce(const BufferRegistry::Region& r) {
  CallSignal& s = call_signal;
  if (s.active && r.buffer->id == s.buffer_id) {
    if (s.waited.buffer != nullptr) return absl::OkStatus();
    KVCD_RETURN_IF_ERROR(buffers_->WaitSignal(r, s.offset, s.value));
    s.waited = r;
    return absl::OkStatus();
  }
  const void* e = r.buffer->ready_event;
  if (e == nullptr) return absl::OkStatus();
  CallWaits& w = call_waits;
  if (w.depth > 0) {
    for (int i = 0; i < w.n; ++i) {
      if (w.events[i] == e) return absl::OkStatus();
    }
  }
  KVCD_RETURN_IF_ERROR(buffers_->WaitReady(r));
  if (w.depth > 0 && w.n < static_cast<int>(sizeof(w.events) / sizeof(w.events[0]))) {
    w.events[w.n++] = e;
  }
  return absl::OkStatus();
}

absl::Status TensorResolver::CheckPayload(const v1::TensorRef& t, absl::string_view field,
                                          int kinds) const {
  const char* name = "inline_data";
  int kind = kInline;
  if (t.payload_case() == v1::TensorRef::kCudaIpc) {
    name = "cuda_ipc";
    kind = kIpc;
  } else if (t.payload_case() == v1::TensorRef::kNccl) {
    name = "nccl";
    kind = kNccl;
  }
  if ((kinds & kind) == 0) {
    std::vector<std::string> want;
    if (kinds & kInline) want.push_back("inline_data");
    if (kinds & kIpc) want.push_back("cuda_ipc");
    if (kinds & kNccl) want.push_back("nccl");
    return absl::InvalidArgumentError(absl::StrCat(field, " carries ", name,
                                                   ", which this field does not accept; expected ",
                                                   absl::StrJoin(want, " or ")));
  }
  if (kind != kInline) {
    absl::Status s = RequireDevice(*backend_).status();
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status TensorResolver::CheckShape(const v1::TensorRef& t, const TensorSpec& spec) const {
  switch (spec.dtypes) {
    case TensorSpec::DTypes::kBf16OrF32:
      KVCD_RETURN_IF_ERROR(
          CheckTensorRef(t, spec.field, spec.shape, {v1::DTYPE_BF16, v1::DTYPE_F32}));
      break;
    case TensorSpec::DTypes::kF32:
      KVCD_RETURN_IF_ERROR(CheckTensorRef(t, spec.field, spec.shape, {v1::DTYPE_F32}));
      break;
    case TensorSpec::DTypes::kU8:
      KVCD_RETURN_IF_ERROR(CheckTensorRef(t, spec.field, spec.shape, {v1::DTYPE_U8}));
      break;
  }
  if (spec.same_dtype_as != nullptr && spec.same_dtype_as->dtype() != t.dtype()) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.field, ".dtype is ", DTypeName(t.dtype()), ", expected the dtype of ",
                     spec.same_dtype_field, " (", DTypeName(spec.same_dtype_as->dtype()), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorResolver::Bytes> TensorResolver::Resolve(const v1::TensorRef& t,
                                                              const TensorSpec& spec) {
  Bytes b;
  KVCD_RETURN_IF_ERROR(ResolveAll({Item{&t, &spec, &b}}));
  return b;
}

absl::Status TensorResolver::ResolveAll(absl::Span<const Item> items) {
  for (const Item& i : items) {
    if (i.spec->shape_after_payload) continue;
    KVCD_RETURN_IF_ERROR(CheckShape(*i.ref, *i.spec));
  }
  for (const Item& i : items) {
    KVCD_RETURN_IF_ERROR(CheckPayload(*i.ref, i.spec->field, i.spec->kinds));
    if (!i.spec->shape_after_payload) continue;
    TensorSpec known = *i.spec;
    KVCD_ASSIGN_OR_RETURN(known.shape, i.spec->shape_after_payload());
    KVCD_RETURN_IF_ERROR(CheckShape(*i.ref, known));
  }
  for (const Item& i : items) {
    KVCD_ASSIGN_OR_RETURN(*i.out, Locate(*i.ref, *i.spec));
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorResolver::Bytes> TensorResolver::Locate(const v1::TensorRef& t,
                                                             const TensorSpec& spec) {
  Bytes b;
  if (t.payload_case() == v1::TensorRef::kNccl) {
    b.is_nccl = true;
    b.nccl_communicator = t.nccl().communicator_id();
    return b;
  }
  if (t.payload_case() != v1::TensorRef::kCudaIpc) {
    b.data = t.inline_data().data();
  } else {
    KVCD_ASSIGN_OR_RETURN(b.region, buffers_->Resolve(t.cuda_ipc(), spec.field));
    if (spec.access != TensorSpec::Access::kWrite) KVCD_RETURN_IF_ERROR(WaitReadyOnce(b.region));
    b.data = reinterpret_cast<const char*>(b.region.ptr);
    b.on_device = true;
    if (spec.host_staging != nullptr) {
      KVCD_ASSIGN_OR_RETURN(DeviceRuntime * device, RequireDevice(*backend_));
      spec.host_staging->resize(b.region.size);
      KVCD_RETURN_IF_ERROR(
          device->CopyDeviceToHost(spec.host_staging->data(), b.region.ptr, b.region.size));
      b.data = spec.host_staging->data();
      b.on_device = false;
    }
  }
  if (spec.scan_host && !b.on_device) KVCD_RETURN_IF_ERROR(CheckFinite(b, t, spec.field));
  return b;
}

absl::Status TensorResolver::CheckFinite(const Bytes& b, const v1::TensorRef& t,
                                         absl::string_view field) const {
  if (t.dtype() != v1::DTYPE_BF16 && t.dtype() != v1::DTYPE_F32) return absl::OkStatus();
  const bool bf16 = t.dtype() == v1::DTYPE_BF16;
  int64_t count = 1;
  for (int64_t d : t.shape()) count *= d;  // checked by CheckTensorRef: no overflow
  if (count <= 0) return absl::OkStatus();
  if (b.on_device) {  // checked by the kernels that read them (cuda_store_rows.h StoreCheck)
    return absl::InternalError(absl::StrCat(field, ": device bytes are not scanned on the host"));
  }
  const int64_t i = kernels::FirstNonFinite(b.data, count, bf16);
  if (i < 0) return absl::OkStatus();
  float x;
  if (bf16) {
    uint16_t h;
    std::memcpy(&h, b.data + 2 * i, 2);
    x = kernels::Bf16ToFloat(h);
  } else {
    std::memcpy(&x, b.data + 4 * i, 4);
  }
  return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] (flat index of ", count, " ",
                                                 bf16 ? "BF16" : "F32", " values) is ",
                                                 std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf"),
                                                 "; expected finite values (nothing was stored)"));
}

}  // namespace kvcd
