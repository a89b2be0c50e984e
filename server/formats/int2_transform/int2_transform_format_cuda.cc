// int2-transform pages in device memory (int2_transform_format_cuda.h). The layout, the host
// checks and the host-side expansion are Int2TransformPageFormat's, shared with the CPU
// implementation.
#include "server/formats/int2_transform/int2_transform_format_cuda.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/env_choice.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "kvcd/kernels/cuda_split_balance.h"
#include "kvcd/kernels/cuda_transform.h"
#include "server/formats/cuda_rows.h"

namespace kvcd {

namespace kc = kernels::cuda;

absl::Status CheckTransformCudaGeometry(const PageGeometry& g, const KeyTransformProfile& p) {
  if (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim is ", g.head_dim,
        ", expected 64, 128 or 256 for int2-transform history (codec file version 3) on the cuda "
        "backend (the CUDA kernels' sizes); the cpu backend serves other sizes"));
  }
  if (g.page_size % 32 != 0 || g.page_size < 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_size is ", g.page_size,
        ", expected a multiple of 32 for int2-transform history (codec file version 3) on the "
        "cuda backend (the attention kernel's 32-token tiles); the cpu backend serves other "
        "sizes"));
  }
  if (p.num_layers() != g.num_layers || p.num_kv_heads() != g.num_kv_heads ||
      p.head_dim() != g.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("the codec file (version 3) is for ", p.num_layers(), " layers x ",
                     p.num_kv_heads(), " KV heads x ", p.head_dim(), ", expected the profile's ",
                     g.num_layers, " x ", g.num_kv_heads, " x ", g.head_dim));
  }
  const int code_bits = p.key_code_bits();
  if (code_bits < 8 || code_bits % 8 != 0 || code_bits > 8 * g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("the codec file's key rows take ", code_bits,
                                                   " code bits, expected a multiple "
                                                   "of 8 in 8..",
                                                   8 * g.head_dim,
                                                   " (8 bits per direction at most)"));
  }
  return absl::OkStatus();
}

namespace {

// KVCD_TRANSFORM_KERNEL: "tc" (default: the int8 tensor-core kernel wherever it serves the
// geometry, the FP32 one elsewhere; 2.5-4x faster than FP32 on the H200,
// bench/results/2026-12-05-h200-s21.md) or "fp32" (the FP32 kernel everywhere, for
// comparison); another value is reported and ignored.
kc::TransformKernel TransformKernelFromEnv() {
  return EnvChoice("KVCD_TRANSFORM_KERNEL", {"tc", "fp32"}) == 0 ? kc::TransformKernel::kTensorCore
                                                                 : kc::TransformKernel::kFp32;
}

class Int2TransformCudaFormat final : public CudaFormat<Int2TransformPageFormat> {
 public:
  Int2TransformCudaFormat(const PageGeometry& g, std::shared_ptr<const KeyTransformProfile> p,
                          std::shared_ptr<const TransformDeviceCodec> dev)
      : CudaFormat(nullptr, g, std::move(p)),
        dev_(std::move(dev)),
        offsets_(transform().layout()),
        kernel_(TransformKernelFromEnv()) {}

  absl::Status WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                          absl::Span<const int32_t> pages, const PagePool& pool) const override {
    const std::vector<RowSlot> rows = PageRowSlots(first_token, pages, geometry().page_size);
    std::lock_guard<std::mutex> lock(scratch_.mu);
    RowStoreArgs a;
    KVCD_RETURN_IF_ERROR(PrepareRowStore(k, v, rows, -1, pool, geometry(), nullptr,
                                         /*rotate=*/false, &scratch_, &a));
    if (rows.empty()) return absl::OkStatus();
    KVCD_RETURN_IF_ERROR(
        CudaStatus(kc::LaunchStoreTransformRows(a.k, a.v, a.dst, offsets_,
                                                dev_->heads(a.first_layer), nullptr, a.check()),
                   "int2-transform quantize-on-put"));
    return FinishRowStore(k, v, a, &scratch_);
  }

  // The window page's rows ([K|V][head][slot][d] BF16, as given) are the source.
  absl::Status Demote(const PagePool& window_pool, absl::Span<const int32_t> src_pages,
                      const PagePool& pool, absl::Span<const int32_t> dst_pages) const override {
    std::lock_guard<std::mutex> lock(scratch_.mu);
    for (size_t i = 0; i < src_pages.size(); ++i) {
      RowStoreArgs a;
      KVCD_RETURN_IF_ERROR(PrepareWindowPageStore(window_pool, src_pages[i], dst_pages[i], pool,
                                                  geometry(), nullptr, &scratch_, &a));
      KVCD_RETURN_IF_ERROR(CudaStatus(
          kc::LaunchStoreTransformRows(a.k, a.v, a.dst, offsets_, dev_->heads(0), nullptr),
          "int2-transform demotion"));
    }
    return absl::OkStatus();
  }

  // Value parameters checked on the device; the key gains (2 bytes per token-head and layer)
  // come to the host for the shared check.
  absl::Status CheckDevicePages(const uint8_t* src, int64_t num_pages,
                                int64_t first_index) const override {
    if (num_pages <= 0) return absl::OkStatus();
    const PageGeometry& g = geometry();
    const int64_t layer_bytes = layer_page_bytes();
    std::lock_guard<std::mutex> lock(scratch_.mu);
    KVCD_RETURN_IF_ERROR(CheckDevicePageRegions(
        src, num_pages, g.num_layers, layer_bytes, offsets_.v_params,
        int64_t{g.num_kv_heads} * offsets_.v_params_head, kc::kCheckFp16ScaleMin,
        static_cast<uint32_t>(g.page_size), first_index,
        "non-finite FP16 value parameter(s) or negative value scale(s)", &scratch_));
    const int64_t width = int64_t{g.num_kv_heads} * g.page_size * 2;
    std::vector<uint16_t> gains(static_cast<size_t>(num_pages * g.num_layers * width / 2));
    KVCD_RETURN_IF_ERROR(
        CudaStatus(kc::Copy2D(gains.data(), static_cast<size_t>(width), src + offsets_.k_gains,
                              static_cast<size_t>(layer_bytes), static_cast<size_t>(width),
                              static_cast<size_t>(num_pages * g.num_layers)),
                   "reading pushed key gains"));
    return transform().CheckKeyGains(gains.data(), num_pages, first_index);
  }

  int AttendSplits(const kc::DecodeGeometry& geo, int max_tokens, int64_t total_tokens,
                   int num_sms) const override {
    // Each kernel's own count for a batch of equal lengths, and its wave: that count for one
    // sequence of one KV head with no bound from the tokens (SMs x resident CTAs per SM).
    constexpr int kUnbounded = 1 << 30;
    const bool tc = TensorCores(geo);
    const int group = geo.num_kv_heads > 0 ? geo.num_q_heads / geo.num_kv_heads : 1;
    const int uniform =
        tc ? kc::TransformTcDecodeSplits(geo.batch, geo.num_q_heads, geo.num_kv_heads, max_tokens,
                                         num_sms)
           : kc::TransformDecodeSplits(geo.batch, geo.num_kv_heads, max_tokens, num_sms);
    const int wave = tc ? kc::TransformTcDecodeSplits(1, group, 1, kUnbounded, num_sms)
                        : kc::TransformDecodeSplits(1, 1, kUnbounded, num_sms);
    return kc::BalancedSplits(uniform, geo.batch, geo.num_kv_heads, max_tokens, total_tokens, wave);
  }

  size_t AttendStateBytes(const kc::DecodeGeometry& geo, int /*max_tokens*/,
                          int /*num_sms*/) const override {
    return TensorCores(geo) ? kc::TransformTcStateBytes(geo.batch, geo.num_kv_heads) : 0;
  }

  // The tensor-core kernel folds; the FP32 one does not (its calls merge with the kernel).
  bool FoldsMerge(const kc::DecodeGeometry& geo) const override {
    return TensorCores(geo) && layer_page_bytes() % 16 == 0;
  }

  absl::Status LaunchAttend(const AttendLaunch& a) const override {
    if (a.geo.num_q_heads % a.geo.num_kv_heads != 0 ||
        a.geo.num_q_heads / a.geo.num_kv_heads > kc::kTransformCudaMaxGroup) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the GQA group is ", a.geo.num_q_heads, " / ", a.geo.num_kv_heads,
          " query heads per KV head, expected at most ", kc::kTransformCudaMaxGroup,
          " for int2-transform history on the cuda backend; the cpu backend serves up to 16"));
    }
    const auto stream = static_cast<cudaStream_t>(a.stream);
    const kc::MergeTarget* fold =
        a.merge != nullptr && a.merge->fold_counters != nullptr ? a.merge : nullptr;
    if (TensorCores(a.geo) && a.state != nullptr && a.list.page_stride % 16 == 0 &&
        reinterpret_cast<uintptr_t>(a.list.pages) % 16 == 0) {
      return CudaStatus(kc::LaunchTransformDecodePartsTc(
                            a.list, a.geo, offsets_, dev_->heads(a.layer), a.q, a.scale, a.splits,
                            a.max_tokens, a.part_o, a.part_lse, a.part_base, a.state, stream, fold),
                        "int2-transform decode attention (tensor cores)");
    }
    if (fold != nullptr) {
      return absl::InternalError(
          "a folded merge was asked of int2-transform pages the tensor-core kernel cannot "
          "attend (FoldsMerge said otherwise)");
    }
    return CudaStatus(kc::LaunchTransformDecodeParts(a.list, a.geo, offsets_, dev_->heads(a.layer),
                                                     a.q, a.scale, a.splits, a.max_tokens, a.part_o,
                                                     a.part_lse, a.part_base, stream),
                      "int2-transform decode attention");
  }

 private:
  const std::shared_ptr<const TransformDeviceCodec> dev_;
  // Whether the tensor-core variant serves this geometry (KVCD_TRANSFORM_KERNEL allowing).
  bool TensorCores(const kc::DecodeGeometry& geo) const {
    return kernel_ == kc::TransformKernel::kTensorCore &&
           kc::TransformTensorCoreServes(geo, offsets_);
  }

  const kc::TransformPageOffsets offsets_;
  const kc::TransformKernel kernel_;
  mutable RowStoreScratch scratch_;
};

}  // namespace

std::unique_ptr<PageFormat> MakeInt2TransformCudaFormat(
    const PageGeometry& geometry, std::shared_ptr<const KeyTransformProfile> profile,
    std::shared_ptr<const TransformDeviceCodec> device_codec) {
  return std::make_unique<Int2TransformCudaFormat>(geometry, std::move(profile),
                                                   std::move(device_codec));
}

}  // namespace kvcd
