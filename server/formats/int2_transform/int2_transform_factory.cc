// int2-transform models: an int2-oscar model whose codec file is version 3
// (KeyTransformProfile); its BF16 window stores rows as given.
#include "server/formats/int2_transform/int2_transform_factory.h"

#include "absl/strings/str_cat.h"
#include "common/key_transform_profile.h"
#include "common/status_macros.h"
#include "server/formats/bf16/bf16_format.h"
#include "server/formats/int2_transform/int2_transform_format.h"
#if KVCD_HAVE_CUDA_FORMATS
#include "server/formats/bf16/bf16_format_cuda.h"
#include "server/formats/int2_transform/int2_transform_format_cuda.h"
#endif

namespace kvcd {
namespace {

class Int2TransformCodec final : public ModelCodec {
 public:
  explicit Int2TransformCodec(std::shared_ptr<const KeyTransformProfile> profile)
      : profile_(std::move(profile)) {}
  FormatId history() const override { return FormatId::kInt2Transform; }
  std::string description() const override {
    return absl::StrCat("int2-transform (codec file version 3, ", profile_->key_code_bits(),
                        " key code bits per row)");
  }
  absl::StatusOr<std::vector<std::unique_ptr<PageFormat>>> CreateFormats(
      const PageGeometry& g, BackendKind kind) const override {
    std::vector<std::unique_ptr<PageFormat>> out;
    if (kind == BackendKind::kCpu) {
      out.push_back(MakeBf16CpuFormat(g, nullptr));
      out.push_back(MakeInt2TransformCpuFormat(g, profile_));
      return out;
    }
#if KVCD_HAVE_CUDA_FORMATS
    KVCD_RETURN_IF_ERROR(CheckTransformCudaGeometry(g, *profile_));
    KVCD_ASSIGN_OR_RETURN(auto device, TransformDeviceCodec::Upload(*profile_));
    out.push_back(MakeBf16CudaFormat(g, nullptr, nullptr));
    out.push_back(MakeInt2TransformCudaFormat(g, profile_, std::move(device)));
    return out;
#else
    return absl::UnimplementedError("this build has no CUDA formats");
#endif
  }

 private:
  const std::shared_ptr<const KeyTransformProfile> profile_;
};

// Version-3 codec files are this format's.
bool Claims(const SafetensorsFile& file) {
  auto v = file.metadata().find("kvcd.codec_version");
  return v != file.metadata().end() && v->second == "3";
}

absl::StatusOr<std::unique_ptr<const ModelCodec>> Load(const ModelSpec& spec,
                                                       const CodecSource& codec) {
  KVCD_ASSIGN_OR_RETURN(const SafetensorsFile* file, codec.Open());
  auto p = KeyTransformProfile::FromSafetensors(*file, spec.num_layers, spec.num_kv_heads,
                                                spec.head_dim);
  if (!p.ok()) return codec.Error(p.status().message());
  return std::make_unique<const Int2TransformCodec>(
      std::make_shared<const KeyTransformProfile>(std::move(*p)));
}

}  // namespace

FormatFactory Int2TransformFactory() { return FormatFactory{&Claims, &Load}; }

}  // namespace kvcd
