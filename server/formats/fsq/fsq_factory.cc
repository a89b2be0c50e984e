// fsq models: the FSQ codec file (docs/fsq.md), required, checked against the profile, and
// the model's RoPE; the bf16+fsq window and the fsq history share it.
#include "server/formats/fsq/fsq_factory.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/formats/fsq/fsq_format.h"
#if KVCD_HAVE_CUDA_FORMATS
#include "server/formats/fsq/fsq_device_codec.h"
#include "server/formats/fsq/fsq_format_cuda.h"
#endif

namespace kvcd {
namespace {

#if KVCD_HAVE_CUDA_FORMATS
// KVCD_FSQ_KERNEL: the key rebuild of the CUDA FSQ decode attention (cuda_fsq_i8.h):
// "int8-2cta-fixed" (the default since session 27: W_k quantized to int8 per row at upload,
// the int8 kernel at two CTAs per SM, the code size compiled in at head_dim 128, G 255-256;
// 0.68-0.77 of int8-2cta's time there, the same elsewhere), "int8-2cta" (the default of
// sessions 25-26: 1.5x the FP16 kernel's speed at G 256, 100k tokens, with 0.1-0.26 of FSQ's
// own rounding error added; bench/results/2026-12-05-h200-fsq-keys.md), "int8" (the int8
// kernel at one CTA per SM) or "fp16" (the reference variant, the float W_k in FP16);
// another value is reported and ignored.
kernels::cuda::FsqKeyKernel FsqKeyKernelFromEnv() {
  constexpr auto kDefault = kernels::cuda::FsqKeyKernel::kInt8Occ2Fixed;
  const char* v = std::getenv("KVCD_FSQ_KERNEL");
  if (v == nullptr) return kDefault;
  std::string names;
  for (const auto k : kernels::cuda::kFsqKeyKernels) {
    if (std::strcmp(v, kernels::cuda::FsqKeyKernelName(k)) == 0) return k;
    absl::StrAppend(&names, names.empty() ? "" : ", ", kernels::cuda::FsqKeyKernelName(k));
  }
  KVCD_LOG(WARNING) << "KVCD_FSQ_KERNEL=" << v << " is not one of " << names
                    << "; using the default (" << kernels::cuda::FsqKeyKernelName(kDefault) << ")";
  return kDefault;
}
#endif

class FsqCodecOfModel final : public ModelCodec {
 public:
  explicit FsqCodecOfModel(std::shared_ptr<const FsqModelCodec> m) : m_(std::move(m)) {}
  FormatId history() const override { return FormatId::kFsq; }
  std::string description() const override {
    return absl::StrCat("fsq G=", m_->codec.shape().latent_width,
                        m_->codec.source().empty() ? "" : " (" + m_->codec.source() + ")");
  }
  absl::StatusOr<std::vector<std::unique_ptr<PageFormat>>> CreateFormats(
      const PageGeometry& g, BackendKind kind) const override {
    std::vector<std::unique_ptr<PageFormat>> out;
    if (kind == BackendKind::kCpu) {
      out.push_back(MakeFsqWindowCpuFormat(g, m_));
      out.push_back(MakeFsqCpuFormat(g, m_));
      return out;
    }
#if KVCD_HAVE_CUDA_FORMATS
    KVCD_RETURN_IF_ERROR(CheckFsqCudaGeometry(g, *m_));
    KVCD_ASSIGN_OR_RETURN(auto device, FsqDeviceCodec::Upload(*m_, FsqKeyKernelFromEnv()));
    out.push_back(MakeFsqWindowCudaFormat(g, m_, device));
    out.push_back(MakeFsqCudaFormat(g, m_, device));
    return out;
#else
    return absl::UnimplementedError("this build has no CUDA formats");
#endif
  }

 private:
  const std::shared_ptr<const FsqModelCodec> m_;
};

absl::StatusOr<std::unique_ptr<const ModelCodec>> Load(const ModelSpec& spec,
                                                       const CodecSource& codec) {
  if (!codec.given()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", Quote(spec.name),
                     ": history_format fsq needs its codec: codec_blob (RegisterModel) or "
                     "codec_file (config), a safetensors file as docs/fsq.md describes"));
  }
  KVCD_ASSIGN_OR_RETURN(const SafetensorsFile* file, codec.Open());
  FsqCodecShape shape;
  shape.num_layers = spec.num_layers;
  shape.residual_width = spec.fsq_residual_width;
  shape.latent_width = spec.fsq_latent_width;
  shape.num_kv_heads = spec.num_kv_heads;
  shape.head_dim = spec.head_dim;
  shape.key_norm = spec.key_norm;
  shape.key_norm_eps = spec.key_norm_eps;
  auto fsq = FsqCodec::FromSafetensors(*file, shape);
  if (!fsq.ok()) return codec.Error(fsq.status().message());
  auto m = std::make_shared<FsqModelCodec>();
  m->codec = std::move(*fsq);
  m->rope.theta = spec.rope_theta;
  m->rope.rotary_dims = spec.rotary_dims();
  m->rope.scaling = spec.rope_scaling;
  m->rope.pairing =
      spec.rope_interleaved ? kernels::RopePairing::kInterleaved : kernels::RopePairing::kHalf;
  return std::make_unique<const FsqCodecOfModel>(std::move(m));
}

}  // namespace

FormatFactory FsqFactory() { return FormatFactory{nullptr, &Load}; }

}  // namespace kvcd
