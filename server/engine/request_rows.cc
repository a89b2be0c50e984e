// CacheEngine::Rows and CacheEngine::Residuals: the K/V rows and FSQ residuals of a
// request where their bytes are, each group resolved by the data plane in one call
// (TensorResolver::ResolveAll) against the specs of tensor_checks.h.
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"
#include "server/engine/cache_engine.h"
#include "server/engine/tensor_checks.h"

namespace kvcd {

absl::StatusOr<CacheEngine::KvRows> CacheEngine::Rows(const v1::TensorRef& k,
                                                      const v1::TensorRef& v, KvNames names,
                                                      std::vector<int64_t> shape, int64_t n,
                                                      const ModelSpec& s) {
  // A NaN or Inf stored in a shared prefix would poison every later reader of it. Host rows
  // on a backend without a device are checked by the CPU formats as they write them, in
  // the same pass over the client's memory, into pages not yet published (a failure frees
  // them); host rows bound for a device are scanned by the resolver first. Rows already on
  // the device (CUDA IPC) are checked by the CUDA store kernels as they read them
  // (RowSource::check_finite): Put and Append wait for the store and fail before
  // publishing; a fused append marks its sequence instead (ModelCache::Attend,
  // DeviceFaultStatus above).
  TensorSpec k_spec = InputSpec(names.k, shape);
  k_spec.scan_host = backend_->device() != nullptr;
  TensorSpec v_spec = InputSpec(names.v, std::move(shape));
  v_spec.scan_host = k_spec.scan_host;
  if (names.same_dtype) {
    v_spec.same_dtype_as = &k;
    v_spec.same_dtype_field = names.k;
  }
  TensorResolver::Bytes kb, vb;
  KVCD_RETURN_IF_ERROR(tensors_.ResolveAll({{&k, &k_spec, &kb}, {&v, &v_spec, &vb}}));
  auto rows = [&](const v1::TensorRef& t, absl::string_view field, const TensorResolver::Bytes& b) {
    RowSource r;
    r.check_finite = b.on_device || !k_spec.scan_host;
    r.name = field;
    r.data = b.data;
    r.on_device = b.on_device;
    r.is_bf16 = t.dtype() == v1::DTYPE_BF16;
    r.token_stride = int64_t{s.num_kv_heads} * s.head_dim;
    r.layer_stride = n * r.token_stride;
    return r;
  };
  return KvRows{rows(k, names.k, kb), rows(v, names.v, vb)};
}

absl::StatusOr<RowSource> CacheEngine::Residuals(const v1::TensorRef& t, bool present,
                                                 absl::string_view field, int64_t layers, int64_t n,
                                                 const ModelSpec& s) {
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
  // Device residuals stay on the device: the format's encoder checks them as it reads
  // them (RowSource::check_finite), as the row stores do for k and v.
  KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes b, tensors_.Resolve(t, InputSpec(field, shape)));
  const bool bf16 = t.dtype() == v1::DTYPE_BF16;
  RowSource r;
  r.is_bf16 = bf16;
  r.token_stride = c;
  r.layer_stride = n * c;
  r.name = field;
  r.data = b.data;
  if (b.on_device) {
    r.on_device = true;
    r.check_finite = true;
    return r;
  }
  const char* bytes = b.data;
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
  return r;
}

}  // namespace kvcd
