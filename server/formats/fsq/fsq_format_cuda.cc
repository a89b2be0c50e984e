// FSQ pages in device memory (fsq_format_cuda.h). The layouts, the host checks and the
// host-side expansion are FsqPageFormat's / FsqWindowPageFormat's, shared with the CPU
// implementation.
#include "server/formats/fsq/fsq_format_cuda.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_fsq.h"
#include "kvcd/kernels/cuda_fsq_encode_tc.h"
#include "kvcd/kernels/cuda_fsq_i8.h"
#include "kvcd/kernels/cuda_page_copy.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "server/formats/bf16/bf16_format_cuda.h"
#include "server/formats/cuda_rows.h"

namespace kvcd {

namespace kc = kernels::cuda;

absl::Status CheckFsqCudaGeometry(const PageGeometry& g, const FsqModelCodec& codec) {
  if (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim is ", g.head_dim,
                     ", expected 64, 128 or 256 for history_format fsq on the cuda backend (the "
                     "CUDA attention kernels' sizes); the cpu backend serves other sizes"));
  }
  if (g.page_size % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_size is ", g.page_size,
        ", expected a multiple of 16 for history_format fsq on the cuda backend (the FSQ "
        "attention kernel's token tiles); the cpu backend serves other sizes"));
  }
  const int32_t rotary = codec.rope.rotary_dims;
  if (rotary < 0 || rotary % 2 != 0 || rotary > g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("rope rotary_dims is ", rotary,
                                                   ", expected an even number in 0..", g.head_dim));
  }
  if (codec.rope.pairing == kernels::RopePairing::kHalf && rotary % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope rotary_dims is ", rotary,
        ", expected a multiple of 16 with the half pairing for history_format fsq on the cuda "
        "backend (the FSQ attention kernel's register tiles); the cpu backend serves it"));
  }
  const FsqCodecShape& s = codec.codec.shape();
  if (s.latent_width > kc::kFsqCudaMaxLatent) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fsq_latent_width is ", s.latent_width, ", expected at most ", kc::kFsqCudaMaxLatent,
        " for history_format fsq on the cuda backend (the FSQ attention kernel keeps the "
        "weighted codes in registers); the cpu backend serves up to ",
        kernels::kFsqMaxLatent));
  }
  if (s.num_layers != g.num_layers || s.num_kv_heads != g.num_kv_heads ||
      s.head_dim != g.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("the FSQ codec is for ", s.num_layers, " layers x ", s.num_kv_heads,
                     " KV heads x ", s.head_dim, ", expected the profile's ", g.num_layers, " x ",
                     g.num_kv_heads, " x ", g.head_dim));
  }
  return absl::OkStatus();
}

namespace {

// What both FSQ formats do with codes on the device: encode residuals into the code rows at
// `codes_offset` of each layer page, and check pushed code rows.
class DeviceCodes {
 public:
  DeviceCodes(const PageGeometry& g, std::shared_ptr<const FsqModelCodec> m,
              std::shared_ptr<const FsqDeviceCodec> dev, int64_t codes_offset)
      : g_(g),
        m_(std::move(m)),
        dev_(std::move(dev)),
        layout_(g, m_->codec.shape().latent_width),
        codes_offset_(codes_offset) {}

  const FsqModelCodec& model() const { return *m_; }
  const FsqDeviceCodec& device() const { return *dev_; }
  const FsqLayout& layout() const { return layout_; }

  absl::Status Encode(const RowSource& x, absl::Span<const RowSlot> rows, int32_t layer,
                      const PagePool& pool) const {
    if (rows.empty()) return absl::OkStatus();
    const FsqCodecShape& s = m_->codec.shape();
    std::lock_guard<std::mutex> lock(scratch_.mu);
    ResidualStoreArgs a;
    KVCD_RETURN_IF_ERROR(
        PrepareResidualStore(x, rows, layer, pool, g_, s.residual_width, &scratch_, &a));
    const kernels::FsqLayerCodec* codecs = dev_->device_layers() + a.first_layer;
    if (dev_->encoder() == FsqDeviceEncoder::kExact) {
      KVCD_RETURN_IF_ERROR(
          CudaStatus(kc::LaunchFsqEncodeRows(a.x, a.dst, codes_offset_, codecs, s.residual_width,
                                             s.latent_width, nullptr, a.check()),
                     "FSQ encode"));
    } else {
      KVCD_RETURN_IF_ERROR(CudaStatus(
          kc::LaunchFsqEncodeRowsTc(a.x, a.dst, codes_offset_, codecs,
                                    dev_->PreparedEncoders(a.first_layer), s.residual_width,
                                    s.latent_width, dev_->tc_operands(), nullptr, a.check()),
          "FSQ encode (tensor cores)"));
    }
    return FinishResidualStore(x, a, &scratch_);
  }

  // Pushed pages in device memory (layer_bytes per layer page): with an odd G the unused
  // high nibble of each code must be 0; the code rows come to the host (they are small)
  // for FsqLayout::CheckCodes.
  absl::Status Check(const uint8_t* src, int64_t num_pages, int64_t first_index,
                     int64_t layer_bytes) const {
    if (m_->codec.shape().latent_width % 2 == 0 || num_pages <= 0) return absl::OkStatus();
    const int64_t width = layout_.codes_bytes();
    std::vector<uint8_t> codes(static_cast<size_t>(num_pages * g_.num_layers * width));
    KVCD_RETURN_IF_ERROR(
        CudaStatus(kc::Copy2D(codes.data(), static_cast<size_t>(width), src + codes_offset_,
                              static_cast<size_t>(layer_bytes), static_cast<size_t>(width),
                              static_cast<size_t>(num_pages * g_.num_layers)),
                   "reading pushed FSQ codes"));
    return layout_.CheckCodes(codes.data(), num_pages, first_index, width, 0);
  }

  RowStoreScratch& scratch() const { return scratch_; }

 private:
  const PageGeometry g_;
  const std::shared_ptr<const FsqModelCodec> m_;
  const std::shared_ptr<const FsqDeviceCodec> dev_;
  const FsqLayout layout_;
  const int64_t codes_offset_;
  mutable RowStoreScratch scratch_;
};

// FSQ history pages in device memory: codes only.
class FsqCudaFormat final : public CudaFormat<FsqPageFormat> {
 public:
  FsqCudaFormat(const PageGeometry& g, std::shared_ptr<const FsqModelCodec> m,
                std::shared_ptr<const FsqDeviceCodec> dev)
      : CudaFormat(nullptr, g, m), codes_(g, std::move(m), std::move(dev), 0) {}

  absl::Status WriteCodes(const RowSource& x, absl::Span<const RowSlot> rows, int32_t layer,
                          const PagePool& pool) const override {
    return codes_.Encode(x, rows, layer, pool);
  }

  // The codes were computed when the tokens arrived; demotion copies them, every layer of
  // a page in one strided copy on the daemon's stream.
  absl::Status Demote(const PagePool& window_pool, absl::Span<const int32_t> src_pages,
                      const PagePool& pool, absl::Span<const int32_t> dst_pages) const override {
    if (window_pool.layer_page_bytes() != layout().window_page_bytes()) {
      return absl::InternalError("fsq pages demote only from bf16+fsq window pages");
    }
    const auto src_pitch =
        static_cast<size_t>(int64_t{window_pool.num_pages()} * window_pool.layer_page_bytes());
    const auto dst_pitch = static_cast<size_t>(int64_t{pool.num_pages()} * pool.layer_page_bytes());
    for (size_t i = 0; i < src_pages.size(); ++i) {
      KVCD_RETURN_IF_ERROR(
          CudaStatus(kc::Copy2D(pool.PagePtr(0, dst_pages[i]), dst_pitch,
                                window_pool.PagePtr(0, src_pages[i]) + layout().window_kv_bytes(),
                                src_pitch, static_cast<size_t>(layout().codes_bytes()),
                                static_cast<size_t>(geometry().num_layers)),
                     "FSQ demotion"));
    }
    return absl::OkStatus();
  }

  absl::Status CheckDevicePages(const uint8_t* src, int64_t num_pages,
                                int64_t first_index) const override {
    return codes_.Check(src, num_pages, first_index, layer_page_bytes());
  }

  // One value-space part per row: the kernel merges its own splits (W_v applied once).
  int AttendSplits(const kc::DecodeGeometry&, int, int64_t, int) const override { return 1; }
  size_t AttendStateBytes(const kc::DecodeGeometry& geo, int max_tokens,
                          int num_sms) const override {
    return kc::FsqDecodeWorkspaceBytes(geo.batch, geo.num_q_heads, LatentWidth(),
                                       Splits(geo, max_tokens, num_sms));
  }
  bool NeedsPositions() const override { return true; }

  absl::Status LaunchAttend(const AttendLaunch& a) const override {
    kc::FsqDecodeArgs args;
    args.codec = codes_.device().Layer(a.layer);
    args.prepared = codes_.device().Prepared(a.layer);
    args.rope = codes_.device().rope();
    args.positions = a.positions;
    args.q = a.q;
    args.softmax_scale = a.scale;
    args.splits = Splits(a.geo, a.max_tokens, a.num_sms);
    args.workspace = a.state;
    return CudaStatus(
        kc::LaunchFsqDecodeParts(codes_.device().key_kernel(), a.list, a.geo, args, a.max_tokens,
                                 a.part_o, a.part_lse, a.part_base, nullptr),
        "FSQ decode attention");
  }

 private:
  int LatentWidth() const { return codes_.model().codec.shape().latent_width; }
  // One wave of the CTAs the device holds at once for the upload's key kernel (two per SM
  // for int8-2cta and int8-2cta-fixed where the geometry fits them, cuda_fsq_i8.h).
  int Splits(const kc::DecodeGeometry& geo, int max_tokens, int num_sms) const {
    return kc::FsqDecodeSplits(codes_.device().key_kernel(), geo, LatentWidth(), max_tokens,
                               num_sms);
  }

  const DeviceCodes codes_;
};

// The BF16 windows of an FSQ model in device memory: the bf16 format's K/V, then each
// token's code.
class FsqWindowCudaFormat final : public CudaFormat<FsqWindowPageFormat> {
 public:
  FsqWindowCudaFormat(const PageGeometry& g, std::shared_ptr<const FsqModelCodec> m,
                      std::shared_ptr<const FsqDeviceCodec> dev)
      : CudaFormat(nullptr, g, m),
        codes_(g, std::move(m), std::move(dev), layout().window_kv_bytes()),
        kv_(MakeBf16CudaFormat(g, nullptr, nullptr)) {}

  // The bf16 format addresses pages through the pool (PagePtr, layer_page_bytes), so it
  // writes and attends the K/V part of these larger pages unchanged.
  absl::Status WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                          absl::Span<const int32_t> pages, const PagePool& pool) const override {
    return kv_->WritePages(k, v, first_token, pages, pool);
  }
  absl::Status WriteRows(const RowSource& k, const RowSource& v, absl::Span<const RowSlot> rows,
                         int32_t layer, const PagePool& pool) const override {
    return kv_->WriteRows(k, v, rows, layer, pool);
  }
  absl::Status WriteCodes(const RowSource& x, absl::Span<const RowSlot> rows, int32_t layer,
                          const PagePool& pool) const override {
    return codes_.Encode(x, rows, layer, pool);
  }

  absl::Status CheckDevicePages(const uint8_t* src, int64_t num_pages,
                                int64_t first_index) const override {
    {
      std::lock_guard<std::mutex> lock(codes_.scratch().mu);
      KVCD_RETURN_IF_ERROR(CheckDevicePageRegions(
          src, num_pages, geometry().num_layers, layer_page_bytes(), 0, layout().window_kv_bytes(),
          kc::kCheckBf16Finite, 0, first_index, "non-finite BF16 value(s)", &codes_.scratch()));
    }
    return codes_.Check(src, num_pages, first_index, layer_page_bytes());
  }

  int AttendSplits(const kc::DecodeGeometry& geo, int max_tokens, int64_t total_tokens,
                   int num_sms) const override {
    return kv_->cuda()->AttendSplits(geo, max_tokens, total_tokens, num_sms);
  }
  absl::Status LaunchAttend(const AttendLaunch& a) const override {
    return kv_->cuda()->LaunchAttend(a);
  }

 private:
  const DeviceCodes codes_;
  const std::unique_ptr<PageFormat> kv_;
};

}  // namespace

std::unique_ptr<PageFormat> MakeFsqCudaFormat(const PageGeometry& geometry,
                                              std::shared_ptr<const FsqModelCodec> codec,
                                              std::shared_ptr<const FsqDeviceCodec> device_codec) {
  return std::make_unique<FsqCudaFormat>(geometry, std::move(codec), std::move(device_codec));
}

std::unique_ptr<PageFormat> MakeFsqWindowCudaFormat(
    const PageGeometry& geometry, std::shared_ptr<const FsqModelCodec> codec,
    std::shared_ptr<const FsqDeviceCodec> device_codec) {
  return std::make_unique<FsqWindowCudaFormat>(geometry, std::move(codec), std::move(device_codec));
}

}  // namespace kvcd
