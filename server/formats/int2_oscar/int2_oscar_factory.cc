// int2-oscar models: the rotations and clips of a codec file (CodecProfile, version 1/2),
// else the named codec ("identity" / "hadamard"), else Hadamard (logged); the BF16 window
// and the INT2 history share them.
#include "server/formats/int2_oscar/int2_oscar_factory.h"

#include <cstdio>

#include "common/codec_profile.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/formats/bf16/bf16_format.h"
#include "server/formats/int2_oscar/int2_oscar_format.h"
#if KVCD_HAVE_CUDA_FORMATS
#include "server/formats/bf16/bf16_format_cuda.h"
#include "server/formats/cuda_codec.h"
#include "server/formats/int2_oscar/int2_oscar_format_cuda.h"
#endif

namespace kvcd {
namespace {

class Int2OscarCodec final : public ModelCodec {
 public:
  explicit Int2OscarCodec(std::shared_ptr<const CodecProfile> rotation)
      : rotation_(std::move(rotation)) {}
  FormatId history() const override { return FormatId::kInt2Oscar; }
  std::string description() const override { return rotation_->description(); }
  absl::StatusOr<std::vector<std::unique_ptr<PageFormat>>> CreateFormats(
      const PageGeometry& g, BackendKind kind) const override {
    std::vector<std::unique_ptr<PageFormat>> out;
    if (kind == BackendKind::kCpu) {
      out.push_back(MakeBf16CpuFormat(g, rotation_));
      out.push_back(MakeInt2OscarCpuFormat(g, rotation_));
      return out;
    }
#if KVCD_HAVE_CUDA_FORMATS
    // One device copy of the rotations for both formats.
    KVCD_ASSIGN_OR_RETURN(std::shared_ptr<const CudaCodec> device, CudaCodec::Upload(*rotation_));
    out.push_back(MakeBf16CudaFormat(g, rotation_, device));
    out.push_back(MakeInt2OscarCudaFormat(g, rotation_, device));
    return out;
#else
    return absl::UnimplementedError("this build has no CUDA formats");
#endif
  }

 private:
  const std::shared_ptr<const CodecProfile> rotation_;
};

absl::StatusOr<std::unique_ptr<const ModelCodec>> Load(const ModelSpec& spec,
                                                       const CodecSource& codec) {
  if (codec.given()) {
    KVCD_ASSIGN_OR_RETURN(const SafetensorsFile* file, codec.Open());
    const std::string what = codec.from_blob() ? std::string("oscar (registered codec)")
                                               : "oscar (" + spec.codec_file + ")";
    auto profile = CodecProfile::FromSafetensors(*file, spec.num_layers, spec.head_dim, what);
    if (!profile.ok()) return codec.Error(profile.status().message());
    return std::make_unique<const Int2OscarCodec>(
        std::make_shared<const CodecProfile>(std::move(*profile)));
  }
  if (spec.codec == "identity") {
    return std::make_unique<const Int2OscarCodec>(std::make_shared<const CodecProfile>(
        CodecProfile::Identity(spec.num_layers, spec.head_dim)));
  }
  auto hadamard =
      std::make_shared<CodecProfile>(CodecProfile::Hadamard(spec.num_layers, spec.head_dim));
  if (spec.codec.empty()) {
    KVCD_LOG(INFO) << "model '" << spec.name
                   << "': no codec file, INT2 history uses the Hadamard rotation";
    hadamard->set_description("hadamard (no codec file)");
  }
  return std::make_unique<const Int2OscarCodec>(std::move(hadamard));
}

}  // namespace

FormatFactory Int2OscarFactory() { return FormatFactory{nullptr, &Load}; }

}  // namespace kvcd
