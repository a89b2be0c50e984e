#include "server/formats/fsq/fsq_format.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/formats/bf16/bf16_format.h"

namespace kvcd {

FsqLayout::FsqLayout(const PageGeometry& g, int latent_width)
    : g_(g),
      latent_width_(latent_width),
      code_bytes_(kernels::FsqCodeBytes(latent_width)),
      window_kv_bytes_(Bf16Format(g).layer_page_bytes()) {}

double FsqLayout::history_bits_per_element() const {
  return 8.0 * static_cast<double>(code_bytes_) / (2.0 * g_.num_kv_heads * g_.head_dim);
}

double FsqLayout::window_bits_per_element() const {
  return 8.0 * static_cast<double>(window_page_bytes()) /
         (2.0 * g_.num_kv_heads * g_.head_dim * g_.page_size);
}

absl::Status FsqLayout::CheckCodes(const uint8_t* src, int64_t num_pages, int64_t first_index,
                                   int64_t layer_bytes, int64_t codes_offset) const {
  if (latent_width_ % 2 == 0) return absl::OkStatus();  // every nibble is a valid z + 8
  for (int64_t p = 0; p < num_pages; ++p) {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      const uint8_t* codes = src + (p * g_.num_layers + l) * layer_bytes + codes_offset;
      for (int32_t t = 0; t < g_.page_size; ++t) {
        if ((codes[(t + 1) * code_bytes_ - 1] & 0xf0u) != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "page ", first_index + p, " layer ", l, " token ", t,
              ": the unused high nibble of the last code byte is not 0 (G = ", latent_width_,
              " is odd)"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status FsqLayout::CheckWindowPages(const uint8_t* src, int64_t num_pages,
                                         int64_t first_index) const {
  const int64_t layer_bytes = window_page_bytes();
  const Bf16Format kv(PageGeometry{1, g_.num_kv_heads, g_.head_dim, g_.page_size});
  for (int64_t p = 0; p < num_pages; ++p) {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      if (!kv.CheckPages(src + (p * g_.num_layers + l) * layer_bytes, 1, 0).ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("page ", first_index + p, " layer ", l, " holds a non-finite BF16 value"));
      }
    }
  }
  return CheckCodes(src, num_pages, first_index, layer_bytes, window_kv_bytes_);
}

void FsqLayout::ExpandCodes(const FsqModelCodec& m, const uint8_t* codes, int32_t layer,
                            int32_t head, int which, int64_t page_first_token, int32_t slot,
                            int32_t count, float* out) const {
  const kernels::FsqLayerCodec codec = m.codec.Layer(layer);
  const int64_t kv = int64_t{g_.num_kv_heads} * g_.head_dim;
  std::vector<float> k(static_cast<size_t>(kv)), v(static_cast<size_t>(kv));
  for (int32_t t = 0; t < count; ++t) {
    const int32_t s = slot + t;
    kernels::FsqExpandToken(codec, m.rope, codes + int64_t{s} * code_bytes_, page_first_token + s,
                            k.data(), v.data());
    std::memcpy(out + int64_t{t} * g_.head_dim,
                (which == 0 ? k : v).data() + int64_t{head} * g_.head_dim,
                sizeof(float) * static_cast<size_t>(g_.head_dim));
  }
}

FsqPageFormat::FsqPageFormat(const PageGeometry& g, std::shared_ptr<const FsqModelCodec> m)
    : PageFormat(FormatId::kFsq, g, nullptr),
      m_(std::move(m)),
      layout_(g, m_->codec.shape().latent_width) {}

absl::Status FsqPageFormat::WritePages(const RowSource&, const RowSource&, int64_t,
                                       absl::Span<const int32_t>, const PagePool&) const {
  return absl::UnimplementedError(
      "fsq history pages hold codes only: they are written from residuals (WriteCodes)");
}

FsqWindowPageFormat::FsqWindowPageFormat(const PageGeometry& g,
                                         std::shared_ptr<const FsqModelCodec> m)
    : PageFormat(FormatId::kFsqWindow, g, nullptr),
      m_(std::move(m)),
      layout_(g, m_->codec.shape().latent_width),
      kv_(g) {}

namespace {

// Encodes rows of x into the code rows at `codes_offset` of each layer page.
absl::Status EncodeInto(const FsqModelCodec& m, const PageGeometry& g, const FsqLayout& layout,
                        int64_t codes_offset, const RowSource& x, absl::Span<const RowSlot> rows,
                        int32_t layer, const PagePool& pool) {
  if (x.on_device) return absl::FailedPreconditionError("the CPU backend cannot read device rows");
  // Runs of consecutive source tokens going to consecutive slots of one page are encoded
  // in one call (the encoder blocks tokens); a code does not depend on the run it is in.
  constexpr size_t kMaxRun = 64;
  const int32_t c = m.codec.shape().residual_width;
  std::vector<float> run(kMaxRun * static_cast<size_t>(c));
  const int32_t l_begin = layer >= 0 ? layer : 0;
  const int32_t l_end = layer >= 0 ? layer + 1 : g.num_layers;
  for (int32_t l = l_begin; l < l_end; ++l) {
    const kernels::FsqLayerCodec codec = m.codec.Layer(l);
    const int64_t src_layer = layer >= 0 ? 0 : l;  // a one-layer source has no layer offset
    for (size_t i = 0; i < rows.size();) {
      const RowSlot& r = rows[i];
      size_t n = 1;
      while (i + n < rows.size() && n < kMaxRun && rows[i + n].page == r.page &&
             rows[i + n].slot == r.slot + static_cast<int32_t>(n) &&
             rows[i + n].src_token == r.src_token + static_cast<int64_t>(n)) {
        ++n;
      }
      for (size_t t = 0; t < n; ++t) {
        KVCD_RETURN_IF_ERROR(x.RowAsFloat(src_layer, r.src_token + static_cast<int64_t>(t), 0, c,
                                          run.data() + t * static_cast<size_t>(c)));
      }
      uint8_t* code =
          pool.PagePtr(l, r.page) + codes_offset + int64_t{r.slot} * layout.code_bytes();
      kernels::FsqEncodeRows(codec, run.data(), static_cast<int64_t>(n), code);
      i += n;
    }
  }
  return absl::OkStatus();
}

// FSQ history pages in host memory: codes only.
class FsqCpuFormat final : public CpuFormat<FsqPageFormat> {
 public:
  using CpuFormat::CpuFormat;

  absl::Status WriteCodes(const RowSource& x, absl::Span<const RowSlot> rows, int32_t layer,
                          const PagePool& pool) const override {
    return EncodeInto(*model(), geometry(), layout(), 0, x, rows, layer, pool);
  }

  // The codes were computed when the tokens arrived; demotion copies them.
  absl::Status Demote(const PagePool& window_pool, absl::Span<const int32_t> src_pages,
                      const PagePool& pool, absl::Span<const int32_t> dst_pages) const override {
    if (window_pool.layer_page_bytes() != layout().window_kv_bytes() + layout().codes_bytes()) {
      return absl::InternalError("fsq pages demote only from bf16+fsq window pages");
    }
    for (size_t i = 0; i < src_pages.size(); ++i) {
      for (int32_t l = 0; l < geometry().num_layers; ++l) {
        std::memcpy(pool.PagePtr(l, dst_pages[i]),
                    window_pool.PagePtr(l, src_pages[i]) + layout().window_kv_bytes(),
                    static_cast<size_t>(layout().codes_bytes()));
      }
    }
    return absl::OkStatus();
  }

  void Attend(const PagePool& pool, int32_t layer, absl::Span<const int32_t> page_ids,
              int64_t first_position, int32_t kv_head, const float* q_rot, int group,
              float softmax_scale, int64_t begin, int64_t end, float* o,
              float* lse) const override {
    kernels::FsqPageTable t;
    t.base = pool.LayerBase(layer);
    t.page_stride = pool.layer_page_bytes();
    t.page_ids = page_ids.data();
    t.num_pages = static_cast<int32_t>(page_ids.size());
    t.page_size = geometry().page_size;
    t.first_position = first_position;
    kernels::AttendFsqPages(t, model()->codec.Layer(layer), model()->rope, kv_head, q_rot, group,
                            softmax_scale, begin, end, o, lse);
  }
};

// The BF16 windows of an FSQ model: the bf16 format's K/V, then each token's code.
class FsqWindowCpuFormat final : public CpuFormat<FsqWindowPageFormat> {
 public:
  using CpuFormat::CpuFormat;

  // The bf16 format addresses pages through the pool (PagePtr, layer_page_bytes), so it
  // writes and reads the K/V part of these larger pages unchanged.
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
    return EncodeInto(*model(), geometry(), layout(), layout().window_kv_bytes(), x, rows, layer,
                      pool);
  }

  void Attend(const PagePool& pool, int32_t layer, absl::Span<const int32_t> page_ids,
              int64_t first_position, int32_t kv_head, const float* q_rot, int group,
              float softmax_scale, int64_t begin, int64_t end, float* o,
              float* lse) const override {
    kv_->cpu()->Attend(pool, layer, page_ids, first_position, kv_head, q_rot, group, softmax_scale,
                       begin, end, o, lse);
  }

 private:
  const std::unique_ptr<PageFormat> kv_ = MakeBf16CpuFormat(geometry(), nullptr);
};

}  // namespace

std::unique_ptr<PageFormat> MakeFsqCpuFormat(const PageGeometry& geometry,
                                             std::shared_ptr<const FsqModelCodec> codec) {
  return std::make_unique<FsqCpuFormat>(geometry, std::move(codec));
}

std::unique_ptr<PageFormat> MakeFsqWindowCpuFormat(const PageGeometry& geometry,
                                                   std::shared_ptr<const FsqModelCodec> codec) {
  return std::make_unique<FsqWindowCpuFormat>(geometry, std::move(codec));
}

}  // namespace kvcd
