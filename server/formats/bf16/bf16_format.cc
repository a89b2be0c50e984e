#include "server/formats/bf16/bf16_format.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd {

int64_t Bf16Format::layer_page_bytes() const {
  return 2 * kernels::Bf16PageElems(g_.num_kv_heads, g_.page_size, g_.head_dim);
}

int64_t Bf16Format::RowOffset(int which, int32_t head, int32_t slot) const {
  return 2 * ((int64_t{which} * g_.num_kv_heads + head) * g_.page_size + slot) * g_.head_dim;
}

absl::Status Bf16Format::CheckPages(const uint8_t* src, int64_t num_pages,
                                    int64_t first_index) const {
  const int64_t layer_bytes = layer_page_bytes();
  for (int64_t p = 0; p < num_pages; ++p) {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      const uint8_t* base = src + (p * g_.num_layers + l) * layer_bytes;
      for (int64_t i = 0; i < layer_bytes / 2; ++i) {
        uint16_t h;
        std::memcpy(&h, base + 2 * i, 2);
        if ((h & 0x7f80u) == 0x7f80u) {
          return absl::InvalidArgumentError(absl::StrCat("page ", first_index + p, " layer ", l,
                                                         " holds a non-finite BF16 value"));
        }
      }
    }
  }
  return absl::OkStatus();
}

void Bf16Format::ReadRows(const uint8_t* layer_page, int32_t head, int which, int32_t slot,
                          int32_t count, float* out) const {
  kernels::Bf16ToFloatN(
      reinterpret_cast<const uint16_t*>(layer_page + RowOffset(which, head, slot)), out,
      int64_t{count} * g_.head_dim);
}

absl::Status Bf16PageFormat::WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                                        absl::Span<const int32_t> pages,
                                        const PagePool& pool) const {
  const std::vector<RowSlot> rows = PageRowSlots(first_token, pages, geometry().page_size);
  return WriteRows(k, v, rows, -1, pool);
}

void Bf16PageFormat::ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head, int which,
                                int64_t /*page_first_token*/, int32_t slot, int32_t count,
                                float* out) const {
  layout_.ReadRows(layer_page, head, which, slot, count, out);
  Unrotate(layer, which, count, out);
}

namespace {

// BF16 pages in host memory; attention by kernels::AttendBf16Pages.
class Bf16CpuFormat final : public CpuFormat<Bf16PageFormat> {
 public:
  using CpuFormat::CpuFormat;

  absl::Status WriteRows(const RowSource& k, const RowSource& v, absl::Span<const RowSlot> rows,
                         int32_t layer, const PagePool& pool) const override {
    if (k.on_device || v.on_device) {
      return absl::FailedPreconditionError("the CPU backend cannot read device rows");
    }
    const PageGeometry& g = geometry();
    const int32_t d = g.head_dim;
    const CodecProfile* rot = rotation();
    // One row at a time on the stack, 64-byte aligned (head_dim <= 256): the rotation's
    // vector loads never straddle cache lines.
    alignas(64) float f[256];
    alignas(64) float rotated[256];
    const int32_t l_begin = layer >= 0 ? layer : 0;
    const int32_t l_end = layer >= 0 ? layer + 1 : g.num_layers;
    for (int32_t l = l_begin; l < l_end; ++l) {
      const int64_t src_layer = layer >= 0 ? 0 : l;  // a one-layer source has no layer offset
      for (const RowSlot& r : rows) {
        uint8_t* page = pool.PagePtr(l, r.page);
        for (int which = 0; which < 2; ++which) {
          const RowSource& src = which == 0 ? k : v;
          for (int32_t h = 0; h < g.num_kv_heads; ++h) {
            auto* dst = reinterpret_cast<uint16_t*>(page + layout().RowOffset(which, h, r.slot));
            if (rot != nullptr) {
              KVCD_RETURN_IF_ERROR(src.RowAsFloat(src_layer, r.src_token, h, d, f));
              kernels::RotateRows(f, 1, d, which == 0 ? rot->RK(l) : rot->RV(l), rotated);
              kernels::FloatToBf16N(rotated, dst, d);
            } else {
              KVCD_RETURN_IF_ERROR(src.RowAsBf16(src_layer, r.src_token, h, d, dst));
            }
          }
        }
      }
    }
    return absl::OkStatus();
  }

  void Attend(const PagePool& pool, int32_t layer, absl::Span<const int32_t> page_ids,
              int64_t /*first_position*/, int32_t kv_head, const float* q_rot, int group,
              float softmax_scale, int64_t begin, int64_t end, float* o,
              float* lse) const override {
    const PageGeometry& g = geometry();
    kernels::Bf16PageTable kv;
    kv.base = reinterpret_cast<const uint16_t*>(pool.LayerBase(layer));
    kv.page_stride = pool.layer_page_bytes() / 2;
    kv.page_ids = page_ids.data();
    kv.num_pages = static_cast<int32_t>(page_ids.size());
    kv.page_size = g.page_size;
    kv.num_kv_heads = g.num_kv_heads;
    kv.head_dim = g.head_dim;
    kernels::AttendBf16Pages(kv, kv_head, q_rot, group, softmax_scale, begin, end, o, lse);
  }
};

}  // namespace

std::unique_ptr<PageFormat> MakeBf16CpuFormat(const PageGeometry& geometry,
                                              std::shared_ptr<const CodecProfile> rotation) {
  return std::make_unique<Bf16CpuFormat>(geometry, std::move(rotation));
}

}  // namespace kvcd
