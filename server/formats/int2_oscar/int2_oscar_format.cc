#include "server/formats/int2_oscar/int2_oscar_format.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd {

int64_t Int2OscarFormat::layer_page_bytes() const {
  return kernels::Int2PageBytes(g_.num_kv_heads, g_.page_size, g_.head_dim);
}

int64_t Int2OscarFormat::ParamsOffset() const {
  return 2 * kernels::Int2PageLayout{g_.num_kv_heads, g_.page_size, g_.head_dim}.KScale(0);
}

int64_t Int2OscarFormat::ParamsCount() const { return 2LL * 2 * g_.num_kv_heads * g_.page_size; }

absl::Status Int2OscarFormat::CheckPages(const uint8_t* src, int64_t num_pages,
                                         int64_t first_index) const {
  const int64_t layer_bytes = layer_page_bytes();
  for (int64_t p = 0; p < num_pages; ++p) {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      const uint8_t* params = src + (p * g_.num_layers + l) * layer_bytes + ParamsOffset();
      for (int64_t i = 0; i < ParamsCount(); ++i) {
        uint16_t h;
        std::memcpy(&h, params + 2 * i, 2);
        const bool is_scale = (i / g_.page_size) % 2 == 0;
        if ((h & 0x7c00u) == 0x7c00u || (is_scale && (h & 0x8000u) != 0 && (h & 0x7fffu) != 0)) {
          return absl::InvalidArgumentError(
              absl::StrCat("page ", first_index + p, " layer ", l,
                           " holds a non-finite FP16 parameter or a negative scale"));
        }
      }
    }
  }
  return absl::OkStatus();
}

void Int2OscarFormat::ReadRows(const uint8_t* layer_page, int32_t head, int which, int32_t slot,
                               int32_t count, float* out) const {
  const kernels::Int2PageLayout layout{g_.num_kv_heads, g_.page_size, g_.head_dim};
  auto* page = const_cast<uint8_t*>(layer_page);  // read only: Int2RowRef is not const-typed
  kernels::ExpandInt2Rows(which == 0 ? layout.K(page, head) : layout.V(page, head), count,
                          g_.head_dim, nullptr, out, slot);
}

namespace {

// INT2 pages in host memory: the codec kernels of kvcd/kernels (AVX-512 / AVX2 / scalar).
class Int2OscarCpuFormat final : public CpuFormat<Int2OscarPageFormat> {
 public:
  using CpuFormat::CpuFormat;

  absl::Status WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                          absl::Span<const int32_t> pages, const PagePool& pool) const override {
    const CodecProfile& codec = *rotation();
    return EncodeRequestPages(geometry(), k, v, first_token, pages, pool,
                              [&](int32_t l, uint8_t* page, int32_t h, int which, float* rows) {
                                Encode(rows, which == 0 ? codec.RK(l) : codec.RV(l), l, h, which,
                                       page);
                              });
  }

  absl::Status Demote(const PagePool& window_pool, absl::Span<const int32_t> src_pages,
                      const PagePool& pool, absl::Span<const int32_t> dst_pages) const override {
    // Window rows are already rotated.
    EncodeWindowPages(geometry(), window_pool, src_pages, pool, dst_pages,
                      [&](int32_t l, uint8_t* page, int32_t h, int which, float* rows) {
                        Encode(rows, nullptr, l, h, which, page);
                      });
    return absl::OkStatus();
  }

  void Attend(const PagePool& pool, int32_t layer, absl::Span<const int32_t> page_ids,
              int64_t /*first_position*/, int32_t kv_head, const float* q_rot, int group,
              float softmax_scale, int64_t begin, int64_t end, float* o,
              float* lse) const override {
    const PageGeometry& g = geometry();
    kernels::Int2PageTable kv;
    kv.base = pool.LayerBase(layer);
    kv.page_stride = pool.layer_page_bytes();
    kv.page_ids = page_ids.data();
    kv.num_pages = static_cast<int32_t>(page_ids.size());
    kv.page_size = g.page_size;
    kv.num_kv_heads = g.num_kv_heads;
    kv.head_dim = g.head_dim;
    kernels::AttendInt2Pages(kv, kv_head, q_rot, group, softmax_scale, begin, end, o, lse);
  }

 private:
  // A page's rows of (head, K or V) of one layer, rotated by `r` (null: already rotated).
  void Encode(const float* rows, const float* r, int32_t l, int32_t h, int which,
              uint8_t* page) const {
    const PageGeometry& g = geometry();
    const kernels::Int2PageLayout layout{g.num_kv_heads, g.page_size, g.head_dim};
    const CodecProfile& codec = *rotation();
    const kernels::Rotation kind = r == nullptr ? kernels::Rotation::kNone
                                   : which == 0 ? codec.KindK(l)
                                                : codec.KindV(l);
    kernels::DemoteRowsToInt2(rows, g.page_size, g.head_dim, r, kind,
                              which == 0 ? codec.RhoK(l) : codec.RhoV(l),
                              which == 0 ? layout.K(page, h) : layout.V(page, h));
  }
};

}  // namespace

std::unique_ptr<PageFormat> MakeInt2OscarCpuFormat(const PageGeometry& geometry,
                                                   std::shared_ptr<const CodecProfile> codec) {
  return std::make_unique<Int2OscarCpuFormat>(geometry, std::move(codec));
}

}  // namespace kvcd
