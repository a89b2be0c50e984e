#include "server/engine/tensor_checks.h"

#include "absl/strings/str_cat.h"
#include "kvcd/kernels/device_fault.h"
#include "server/cache/model_cache.h"

namespace kvcd {

TensorSpec InputSpec(absl::string_view field, std::vector<int64_t> shape) {
  TensorSpec spec;
  spec.field = field;
  spec.shape = std::move(shape);
  spec.dtypes = TensorSpec::DTypes::kBf16OrF32;
  spec.kinds = kInputKinds;
  return spec;
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

}  // namespace kvcd
