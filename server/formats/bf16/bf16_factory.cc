// BF16 models: no codec, BF16 window pages only (the history stays in the window format).
#include "server/formats/bf16/bf16_factory.h"

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "server/formats/bf16/bf16_format.h"
#if KVCD_HAVE_CUDA_FORMATS
#include "server/formats/bf16/bf16_format_cuda.h"
#endif

namespace kvcd {
namespace {

class Bf16Codec final : public ModelCodec {
 public:
  FormatId history() const override { return FormatId::kBf16; }
  std::string description() const override { return "bf16"; }
  absl::StatusOr<std::vector<std::unique_ptr<PageFormat>>> CreateFormats(
      const PageGeometry& g, BackendKind kind) const override {
    std::vector<std::unique_ptr<PageFormat>> out;
    if (kind == BackendKind::kCpu) {
      out.push_back(MakeBf16CpuFormat(g, nullptr));
      return out;
    }
#if KVCD_HAVE_CUDA_FORMATS
    out.push_back(MakeBf16CudaFormat(g, nullptr, nullptr));
    return out;
#else
    return absl::UnimplementedError("this build has no CUDA formats");
#endif
  }
};

absl::StatusOr<std::unique_ptr<const ModelCodec>> Load(const ModelSpec& spec,
                                                       const CodecSource& codec) {
  if (codec.from_blob()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", Quote(spec.name), ": codec_blob is only used with history_format int2-oscar"));
  }
  return std::make_unique<const Bf16Codec>();
}

}  // namespace

FormatFactory Bf16Factory() { return FormatFactory{nullptr, &Load}; }

}  // namespace kvcd
