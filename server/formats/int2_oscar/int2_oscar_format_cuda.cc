// OSCAR INT2 pages in device memory (layout, checks and expansion: Int2OscarPageFormat):
// quantize-on-put and demotion by the paged INT2 row
// store (bit-identical to the CPU codec), attention by the INT2 tensor-core decode kernel,
// which also merges every part of the call (windows included).
#include "server/formats/int2_oscar/int2_oscar_format_cuda.h"

#include "common/status_macros.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "kvcd/kernels/cuda_split_balance.h"
#include "server/formats/cuda_rows.h"
#include "server/formats/int2_oscar/int2_oscar_format.h"

namespace kvcd {
namespace {

namespace kc = kernels::cuda;

class Int2OscarCudaFormat final : public CudaFormat<Int2OscarPageFormat> {
 public:
  using CudaFormat::CudaFormat;

  absl::Status WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                          absl::Span<const int32_t> pages, const PagePool& pool) const override {
    const std::vector<RowSlot> rows = PageRowSlots(first_token, pages, geometry().page_size);
    std::lock_guard<std::mutex> lock(scratch_.mu);
    RowStoreArgs a;
    KVCD_RETURN_IF_ERROR(PrepareRowStore(k, v, rows, -1, pool, geometry(), device_codec(),
                                         /*rotate=*/true, &scratch_, &a));
    if (rows.empty()) return absl::OkStatus();
    KVCD_RETURN_IF_ERROR(
        CudaStatus(kc::LaunchStoreInt2Rows(a.k, a.v, a.dst, a.codec, nullptr, a.check()),
                   "INT2 quantize-on-put"));
    return FinishRowStore(k, v, a, &scratch_);
  }

  absl::Status Demote(const PagePool& window_pool, absl::Span<const int32_t> src_pages,
                      const PagePool& pool, absl::Span<const int32_t> dst_pages) const override {
    std::lock_guard<std::mutex> lock(scratch_.mu);
    for (size_t i = 0; i < src_pages.size(); ++i) {
      // The window page's rows ([K|V][head][slot][d], already rotated) are the source.
      RowStoreArgs a;
      KVCD_RETURN_IF_ERROR(PrepareWindowPageStore(window_pool, src_pages[i], dst_pages[i], pool,
                                                  geometry(), device_codec(), &scratch_, &a));
      KVCD_RETURN_IF_ERROR(
          CudaStatus(kc::LaunchStoreInt2Rows(a.k, a.v, a.dst, a.codec, nullptr), "INT2 demotion"));
    }
    return absl::OkStatus();
  }

  absl::Status CheckDevicePages(const uint8_t* src, int64_t num_pages,
                                int64_t first_index) const override {
    std::lock_guard<std::mutex> lock(scratch_.mu);
    return CheckDevicePageRegions(src, num_pages, geometry().num_layers, layer_page_bytes(),
                                  layout().ParamsOffset(), 2 * layout().ParamsCount(),
                                  kc::kCheckFp16ScaleMin,
                                  static_cast<uint32_t>(geometry().page_size), first_index,
                                  "non-finite FP16 parameter(s) or negative scale(s)", &scratch_);
  }

  int AttendSplits(const kc::DecodeGeometry& geo, int max_tokens, int64_t total_tokens,
                   int num_sms) const override {
    const int per_sm = kc::Int2CtasPerSm(geo.num_q_heads, geo.num_kv_heads, geo.head_dim);
    return kc::BalancedSplits(
        kc::Int2DecodeSplits(geo.batch, geo.num_kv_heads, max_tokens, num_sms, per_sm), geo.batch,
        geo.num_kv_heads, max_tokens, total_tokens, int64_t{per_sm} * num_sms);
  }
  size_t AttendStateBytes(const kc::DecodeGeometry& geo, int /*max_tokens*/,
                          int /*num_sms*/) const override {
    return kc::Int2StateBytes(geo.batch, geometry().num_kv_heads);
  }
  bool FusesMerge() const override { return true; }
  bool FoldsMerge(const kc::DecodeGeometry& /*geo*/) const override { return true; }
  bool ReadsRawQueries() const override { return true; }

  absl::Status LaunchAttend(const AttendLaunch& a) const override {
    kc::Int2PartsOptions opt;
    opt.state = a.state;
    opt.merge = a.merge;
    opt.raw = a.raw;
    return CudaStatus(
        kc::LaunchInt2DecodeParts(a.list, a.geo, a.q, a.r_k, a.scale, a.splits, a.max_tokens,
                                  a.part_o, a.part_lse, a.part_base, nullptr, opt),
        "INT2 decode attention");
  }

 private:
  mutable RowStoreScratch scratch_;
};

}  // namespace

std::unique_ptr<PageFormat> MakeInt2OscarCudaFormat(const PageGeometry& geometry,
                                                    std::shared_ptr<const CodecProfile> codec,
                                                    std::shared_ptr<const CudaCodec> device_codec) {
  return std::make_unique<Int2OscarCudaFormat>(std::move(device_codec), geometry, std::move(codec));
}

}  // namespace kvcd
