#include "server/formats/int2_transform/transform_device_codec.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "server/formats/cuda_codec.h"

namespace kvcd {

namespace kc = kernels::cuda;

absl::StatusOr<std::shared_ptr<const TransformDeviceCodec>> TransformDeviceCodec::Upload(
    const KeyTransformProfile& p) {
  const int layers = p.num_layers(), heads = p.num_kv_heads();
  std::vector<kc::TransformHeadSource> src;
  for (int l = 0; l < layers; ++l) {
    for (int h = 0; h < heads; ++h) {
      kc::TransformHeadSource s;
      s.key = p.KeyCode(l, h);
      s.r_v = p.head(l, h).r_v.data();
      s.rho_v = p.head(l, h).rho_v;
      src.push_back(s);
    }
  }
  const int n = static_cast<int>(src.size());
  const size_t bytes = kc::TransformCodecBytes(n, p.head_dim());
  std::shared_ptr<TransformDeviceCodec> c(new TransformDeviceCodec());
  KVCD_RETURN_IF_ERROR(
      KernelStatus(kc::Malloc(&c->memory_, bytes), absl::StatusCode::kResourceExhausted,
                   absl::StrCat("cannot allocate ", bytes,
                                " bytes of device memory for the int2-transform codec")));
  c->bytes_ = bytes;
  c->num_kv_heads_ = heads;
  std::vector<uint8_t> image(bytes);
  c->device_heads_ = kc::BuildTransformCodecImage(src.data(), n, c->memory_, image.data());
  KVCD_RETURN_IF_ERROR(
      CudaStatus(kc::CopyToDevice(c->memory_, image.data(), bytes), "int2-transform codec upload"));
  return std::shared_ptr<const TransformDeviceCodec>(std::move(c));
}

TransformDeviceCodec::~TransformDeviceCodec() {
  if (memory_ != nullptr) (void)kc::Free(memory_);
}

}  // namespace kvcd
