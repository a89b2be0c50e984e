// BF16 pages in device memory (layout, checks and expansion: Bf16PageFormat): rows stored by
// the paged BF16 row store, attention by the
// split tensor-core BF16 kernel of kernels/cuda (cuda_bf16_split_attention.h), or the first
// BF16 kernel (one warp per token) with KVCD_BF16_KERNEL=warp, kept for comparison.
#include "server/formats/bf16/bf16_format_cuda.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/env_choice.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_bf16_split_attention.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_split_balance.h"
#include "server/formats/bf16/bf16_format.h"
#include "server/formats/cuda_rows.h"

namespace kvcd {
namespace {

namespace kc = kernels::cuda;

// KVCD_BF16_KERNEL: "split" (default) or "warp"; another value is reported and ignored.
kc::Bf16Kernel Bf16KernelFromEnv() {
  return EnvChoice("KVCD_BF16_KERNEL", {"split", "warp"}) == 0 ? kc::Bf16Kernel::kSplit
                                                               : kc::Bf16Kernel::kWarp;
}

class Bf16CudaFormat final : public CudaFormat<Bf16PageFormat> {
 public:
  Bf16CudaFormat(const PageGeometry& g, std::shared_ptr<const CodecProfile> rotation,
                 std::shared_ptr<const CudaCodec> device_codec)
      : CudaFormat(std::move(device_codec), g, std::move(rotation)), kernel_(Bf16KernelFromEnv()) {}

  absl::Status WriteRows(const RowSource& k, const RowSource& v, absl::Span<const RowSlot> rows,
                         int32_t layer, const PagePool& pool) const override {
    std::lock_guard<std::mutex> lock(scratch_.mu);
    RowStoreArgs a;
    KVCD_RETURN_IF_ERROR(PrepareRowStore(k, v, rows, layer, pool, geometry(), device_codec(),
                                         /*rotate=*/true, &scratch_, &a));
    if (rows.empty()) return absl::OkStatus();
    // A pipelined call's store may run beside the attention of the older tokens (it answers
    // without waiting for it: a.sync is false).
    void* stream = nullptr;
    if (k.row_stream != nullptr && k.device_faults != nullptr && !a.sync) {
      KVCD_ASSIGN_OR_RETURN(stream, k.row_stream->Fork());
    }
    KVCD_RETURN_IF_ERROR(
        CudaStatus(kc::LaunchStoreBf16Rows(a.k, a.v, a.dst, a.codec,
                                           static_cast<cudaStream_t>(stream), a.check()),
                   "BF16 row store"));
    return FinishRowStore(k, v, a, &scratch_);
  }

  absl::Status CheckDevicePages(const uint8_t* src, int64_t num_pages,
                                int64_t first_index) const override {
    std::lock_guard<std::mutex> lock(scratch_.mu);
    return CheckDevicePageRegions(src, num_pages, geometry().num_layers, layer_page_bytes(), 0,
                                  layer_page_bytes(), kc::kCheckBf16Finite, 0, first_index,
                                  "non-finite BF16 value(s)", &scratch_);
  }

  int AttendSplits(const kc::DecodeGeometry& geo, int max_tokens, int64_t total_tokens,
                   int num_sms) const override {
    const int uniform = kc::Bf16DecodeSplits(kernel_, geo.batch, geo.num_kv_heads, geo.head_dim,
                                             max_tokens, num_sms);
    if (kernel_ != kc::Bf16Kernel::kSplit) return uniform;
    return kc::BalancedSplits(uniform, geo.batch, geo.num_kv_heads, max_tokens, total_tokens,
                              int64_t{std::max(1, kc::Bf16SplitCtasPerSm(geo.head_dim))} * num_sms);
  }

  bool ReadsRawQueries() const override { return true; }
  bool RunsOnSideStream() const override { return true; }
  bool FoldsMerge(const kc::DecodeGeometry& /*geo*/) const override { return true; }
  absl::Status LaunchAttend(const AttendLaunch& a) const override {
    // A BF16 list merges only by the fold (FusesMerge is false: no merge target otherwise).
    const kc::MergeTarget* fold =
        a.merge != nullptr && a.merge->fold_counters != nullptr ? a.merge : nullptr;
    return CudaStatus(kc::LaunchBf16Parts(kernel_, a.list, a.geo, a.q, a.r_k, a.scale, a.splits,
                                          a.max_tokens, a.part_o, a.part_lse, a.part_base,
                                          static_cast<cudaStream_t>(a.stream), a.raw, fold),
                      "BF16 decode attention");
  }

 private:
  const kc::Bf16Kernel kernel_;
  mutable RowStoreScratch scratch_;
};

}  // namespace

std::unique_ptr<PageFormat> MakeBf16CudaFormat(const PageGeometry& geometry,
                                               std::shared_ptr<const CodecProfile> rotation,
                                               std::shared_ptr<const CudaCodec> device_codec) {
  return std::make_unique<Bf16CudaFormat>(geometry, std::move(rotation), std::move(device_codec));
}

}  // namespace kvcd
