#include "server/engine/tensor_checks.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/device_fault.h"
#include "proto/tensor_ref.h"
#include "server/engine/cache_engine.h"

namespace kvcd {

absl::Status CheckKv(const ModelSpec& s, const v1::TensorRef& k, const v1::TensorRef& v,
                     int64_t n) {
  const std::vector<int64_t> shape = {s.num_layers, n, s.num_kv_heads, s.head_dim};
  KVCD_RETURN_IF_ERROR(CheckTensorRef(k, "k", shape, {v1::DTYPE_BF16, v1::DTYPE_F32}));
  KVCD_RETURN_IF_ERROR(CheckTensorRef(v, "v", shape, {v1::DTYPE_BF16, v1::DTYPE_F32}));
  if (k.dtype() != v.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("v.dtype is ", DTypeName(v.dtype()),
                                                   ", expected the dtype of k (",
                                                   DTypeName(k.dtype()), ")"));
  }
  return absl::OkStatus();
}

absl::Status DeviceFaultStatus(const Sequence& seq, bool this_call) {
  const uint64_t w = seq.device_fault.Read();
  if (w == 0) return absl::OkStatus();
  // The FSQ encoder reports a bad residual row as the keys' input (cuda_fsq.h).
  const kernels::FaultInput input = kernels::FaultInputOf(w);
  const bool fsq_keys = input == kernels::kFaultKNew && seq.model->spec().is_fsq();
  return absl::InvalidArgumentError(absl::StrCat(
      "sequence ", seq.id, ": ", kernels::FaultInputName(input), fsq_keys ? " or x_new" : "",
      " of ", this_call ? "this (or an earlier)" : "an earlier", " AttentionDecode call (layer ",
      kernels::FaultLayerOf(w),
      ") held NaN or +-Inf in device memory; that call's outputs for it are NaN and the "
      "sequence cannot be used any more: close it and open a new one"));
}

absl::StatusOr<RowSource> CacheEngine::Rows(const v1::TensorRef& t, absl::string_view field,
                                            int64_t n, const ModelSpec& s) {
  KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes b, tensors_.Input(t, field));
  // A NaN or Inf stored in a shared prefix would poison every later reader of it. Host rows
  // on a backend without a device are checked by the CPU formats as they write them, in
  // the same pass over the client's memory, into pages not yet published (a failure frees
  // them); host rows bound for a device are checked here first. Rows already on the device
  // (CUDA IPC) are checked by the CUDA store kernels as they read them (RowSource::
  // check_finite): Put and Append wait for the store and fail before publishing; a fused
  // append marks its sequence instead (ModelCache::Attend, DeviceFaultStatus above).
  RowSource r;
  r.check_finite = b.on_device || backend_->device() == nullptr;
  r.name = field;
  if (!r.check_finite) KVCD_RETURN_IF_ERROR(tensors_.CheckFinite(b, t, field));
  r.data = b.data;
  r.on_device = b.on_device;
  r.is_bf16 = t.dtype() == v1::DTYPE_BF16;
  r.token_stride = int64_t{s.num_kv_heads} * s.head_dim;
  r.layer_stride = n * r.token_stride;
  return r;
}

absl::StatusOr<RowSource> CacheEngine::Residuals(const v1::TensorRef& t, bool present,
                                                 absl::string_view field, int64_t layers, int64_t n,
                                                 const ModelSpec& s, std::string* staging) {
  if (!s.is_fsq()) {
    if (present) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " is set, expected it absent: model '", s.name, "' has history_format ",
          FormatName(s.history_format), " (residuals are only for history_format fsq)"));
    }
    return RowSource{};
  }
  const int64_t c = s.fsq_residual_width;
  std::vector<int64_t> shape = {n, c};
  if (layers > 0) shape.insert(shape.begin(), layers);
  if (!present) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is missing: model '", s.name, "' stores FSQ codes, expected the residuals [",
        absl::StrJoin(shape, ", "), "] (BF16 or F32) beside the K/V"));
  }
  KVCD_RETURN_IF_ERROR(CheckTensorRef(t, field, shape, {v1::DTYPE_BF16, v1::DTYPE_F32}));
  KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(t, field, kInputKinds));
  const bool bf16 = t.dtype() == v1::DTYPE_BF16;
  RowSource r;
  r.is_bf16 = bf16;
  r.token_stride = c;
  r.layer_stride = n * c;
  r.name = field;
  if (t.payload_case() == v1::TensorRef::kCudaIpc) {
    // Device residuals stay on the device: the format's encoder checks them as it reads
    // them (RowSource::check_finite), as the row stores do for k and v.
    KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes b, tensors_.Input(t, field));
    r.data = b.data;
    r.on_device = true;
    r.check_finite = true;
    return r;
  }
  KVCD_ASSIGN_OR_RETURN(const char* bytes, tensors_.HostInput(t, field, staging));
  const int64_t total = (layers > 0 ? layers : 1) * n * c;
  for (int64_t i = 0; i < total; ++i) {
    float f;
    if (bf16) {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      f = kernels::Bf16ToFloat(h);
    } else {
      std::memcpy(&f, bytes + 4 * i, 4);
    }
    if (!std::isfinite(f)) {
      const int64_t ch = i % c, tok = (i / c) % n, layer = i / (c * n);
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", layers > 0 ? absl::StrCat(layer, ", ") : "", tok, ", ", ch,
                       "] is ", f, ", expected finite residuals"));
    }
  }
  r.data = bytes;
  return r;
}

}  // namespace kvcd
