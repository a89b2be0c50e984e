#include "server/formats/fsq/fsq_device_codec.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/env_choice.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_fsq_i8.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "server/formats/cuda_codec.h"

namespace kvcd {

namespace kc = kernels::cuda;

namespace {

constexpr size_t kAlign = 256;
size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// The FP16 tensor-core encoder since session 25 (bench/results/2026-12-05-h200-fsq-enc.md: a
// 32k-token prompt of 36 layers in 14.9 ms against the float64 encoder's 613 ms on an H100,
// 0.09% of the codes one step from the float64 definition, none further; memcheck and
// racecheck clean), first of KVCD_FSQ_ENCODER's names. "exact" keeps the bit-identical float64
// encoder, the oracle.
constexpr FsqDeviceEncoder kByName[] = {FsqDeviceEncoder::kTcFp16, FsqDeviceEncoder::kExact,
                                        FsqDeviceEncoder::kTcBf16, FsqDeviceEncoder::kTcSplit};

}  // namespace

FsqDeviceEncoder FsqDeviceEncoderFromEnv() {
  return kByName[EnvChoice("KVCD_FSQ_ENCODER", {"tc-fp16", "exact", "tc", "tc-split"})];
}

absl::StatusOr<std::shared_ptr<const FsqDeviceCodec>> FsqDeviceCodec::Upload(
    const FsqModelCodec& m, kc::FsqKeyKernel key_kernel) {
  const FsqCodecShape& shape = m.codec.shape();
  const int layers = shape.num_layers;
  const size_t prepared_bytes =
      kc::FsqDecoderBytes(key_kernel, shape.num_kv_heads, shape.head_dim, shape.latent_width);
  // One allocation: per layer its tensors and its prepared decoder, then the layer array.
  // Host image of the tensors and the array first; offsets are relative to the base.
  std::vector<uint8_t> image;
  struct Offsets {
    size_t encoder, encoder_bias, decoder_k, decoder_v, bias_k, bias_v, key_norm, prepared;
  };
  std::vector<Offsets> at(static_cast<size_t>(layers));
  auto put = [&image](const std::vector<float>& t) {
    const size_t off = image.size();
    image.resize(off + Aligned(t.size() * sizeof(float)));
    if (!t.empty()) std::memcpy(image.data() + off, t.data(), t.size() * sizeof(float));
    return off;
  };
  for (int l = 0; l < layers; ++l) {
    const FsqLayerTensors& t = m.codec.layer(l);
    Offsets& o = at[static_cast<size_t>(l)];
    o.encoder = put(t.encoder);
    o.encoder_bias = put(t.encoder_bias);
    o.decoder_k = put(t.decoder_k);
    o.decoder_v = put(t.decoder_v);
    o.bias_k = put(t.bias_k);
    o.bias_v = put(t.bias_v);
    o.key_norm = put(t.key_norm);
    o.prepared = image.size();
    image.resize(o.prepared + Aligned(prepared_bytes));
  }
  const size_t array_at = image.size();
  image.resize(Aligned(array_at + sizeof(kernels::FsqLayerCodec) * static_cast<size_t>(layers)));
  // The tensor-core encoders' prepared weights, every layer back to back (written on the
  // device from the F32 encoder; the host image leaves them zero).
  std::shared_ptr<FsqDeviceCodec> c(new FsqDeviceCodec());
  const FsqDeviceEncoder encoder = FsqDeviceEncoderFromEnv();
  c->encoder_ = encoder;
  const size_t encoders_at = image.size();
  if (encoder != FsqDeviceEncoder::kExact) {
    c->encoder_bytes_ =
        kc::FsqEncoderTcBytes(shape.residual_width, shape.latent_width, c->tc_operands());
    image.resize(encoders_at + c->encoder_bytes_ * static_cast<size_t>(layers));
  }

  KVCD_RETURN_IF_ERROR(KernelStatus(
      kc::Malloc(&c->memory_, image.size()), absl::StatusCode::kResourceExhausted,
      absl::StrCat("cannot allocate ", image.size(), " bytes of device memory for the FSQ codec")));
  auto* base = static_cast<uint8_t*>(c->memory_);
  auto dev = [base](size_t off) { return reinterpret_cast<const float*>(base + off); };
  for (int l = 0; l < layers; ++l) {
    const Offsets& o = at[static_cast<size_t>(l)];
    kernels::FsqLayerCodec v = m.codec.Layer(l);  // sizes and eps; pointers replaced
    v.encoder = dev(o.encoder);
    v.encoder_bias = dev(o.encoder_bias);
    v.decoder_k = dev(o.decoder_k);
    v.decoder_v = dev(o.decoder_v);
    v.bias_k = dev(o.bias_k);
    v.bias_v = dev(o.bias_v);
    v.key_norm = m.codec.layer(l).key_norm.empty() ? nullptr : dev(o.key_norm);
    c->layers_.push_back(v);
    c->prepared_.push_back(base + o.prepared);
  }
  std::memcpy(image.data() + array_at, c->layers_.data(),
              sizeof(kernels::FsqLayerCodec) * c->layers_.size());
  c->device_layers_ = reinterpret_cast<const kernels::FsqLayerCodec*>(base + array_at);
  c->prepared_encoders_ = base + encoders_at;
  c->rope_ = m.rope;
  c->key_kernel_ = key_kernel;
  KVCD_RETURN_IF_ERROR(
      CudaStatus(kc::CopyToDevice(base, image.data(), image.size()), "FSQ codec upload"));
  for (int l = 0; l < layers; ++l) {
    KVCD_RETURN_IF_ERROR(CudaStatus(
        kc::LaunchFsqPrepareDecoder(key_kernel, c->layers_[static_cast<size_t>(l)],
                                    const_cast<void*>(c->prepared_[static_cast<size_t>(l)]),
                                    nullptr),
        "FSQ key decoder preparation"));
    if (encoder != FsqDeviceEncoder::kExact) {
      KVCD_RETURN_IF_ERROR(CudaStatus(
          kc::LaunchFsqPrepareEncoderTc(c->layers_[static_cast<size_t>(l)].encoder,
                                        shape.residual_width, shape.latent_width, c->tc_operands(),
                                        const_cast<void*>(c->PreparedEncoders(l)), nullptr),
          "FSQ encoder preparation"));
    }
  }
  KVCD_RETURN_IF_ERROR(CudaStatus(kc::Synchronize(), "FSQ codec preparation"));
  return std::shared_ptr<const FsqDeviceCodec>(std::move(c));
}

FsqDeviceCodec::~FsqDeviceCodec() {
  if (memory_ != nullptr) (void)kc::Free(memory_);
}

}  // namespace kvcd
