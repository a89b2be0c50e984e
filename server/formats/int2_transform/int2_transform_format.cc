#include "server/formats/int2_transform/int2_transform_format.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvcd/kernels/int2_codec.h"
#include "kvcd/kernels/transform_attention.h"

namespace kvcd {

Int2TransformLayout::Int2TransformLayout(const PageGeometry& g,
                                         std::shared_ptr<const KeyTransformProfile> p)
    : g_(g),
      profile_(std::move(p)),
      layout_{g.num_kv_heads, g.page_size, g.head_dim, profile_->key_code_bits() / 8} {}

double Int2TransformLayout::bits_per_element() const {
  const double d = g_.head_dim;
  return (profile_->key_code_bits() + 16 + 2 * d + 32) / (2 * d);
}

absl::Status Int2TransformLayout::CheckPages(const uint8_t* src, int64_t num_pages,
                                             int64_t first_index) const {
  const int64_t layer_bytes = layer_page_bytes();
  auto bad = [&](int64_t p, int32_t l, const char* what) {
    return absl::InvalidArgumentError(
        absl::StrCat("page ", first_index + p, " layer ", l, " holds ", what));
  };
  for (int64_t p = 0; p < num_pages; ++p) {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      const uint8_t* page = src + (p * g_.num_layers + l) * layer_bytes;
      for (int32_t h = 0; h < g_.num_kv_heads; ++h) {
        for (int32_t t = 0; t < g_.page_size; ++t) {
          uint16_t gain;
          std::memcpy(&gain, page + layout_.KGains(h) + 2 * t, 2);
          if (!ValidKeyGain(gain)) {
            return bad(p, l, "a key gain that is not a positive finite FP16 value");
          }
          for (int k = 0; k < 2; ++k) {
            uint16_t x;
            std::memcpy(&x, page + layout_.VParams(h) + 2 * (k * g_.page_size + t), 2);
            if ((x & 0x7c00u) == 0x7c00u || (k == 0 && (x & 0x8000u) != 0 && (x & 0x7fffu) != 0)) {
              return bad(p, l, "a non-finite FP16 value parameter or a negative value scale");
            }
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Int2TransformLayout::CheckKeyGains(const uint16_t* gains, int64_t num_pages,
                                                int64_t first_index) const {
  const int64_t block = int64_t{g_.num_kv_heads} * g_.page_size;
  for (int64_t p = 0; p < num_pages; ++p) {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      const uint16_t* b = gains + (p * g_.num_layers + l) * block;
      for (int64_t i = 0; i < block; ++i) {
        if (!ValidKeyGain(b[i])) {
          return absl::InvalidArgumentError(
              absl::StrCat("page ", first_index + p, " layer ", l,
                           " holds a key gain that is not a positive finite FP16 value"));
        }
      }
    }
  }
  return absl::OkStatus();
}

void Int2TransformLayout::ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head,
                                     int which, int32_t slot, int32_t count, float* out) const {
  auto* page = const_cast<uint8_t*>(layer_page);  // read only: Int2RowRef is not const-typed
  if (which == 0) {
    kernels::DecodeTransformKeys(
        profile_->KeyCode(layer, head),
        page + layout_.KCodes(head) + int64_t{slot} * layout_.code_bytes, layout_.code_bytes,
        reinterpret_cast<const uint16_t*>(page + layout_.KGains(head)) + slot, 1, count, out);
  } else {
    kernels::ExpandInt2Rows(layout_.V(page, head), count, g_.head_dim,
                            profile_->head(layer, head).r_v.data(), out, slot);
  }
}

void Int2TransformLayout::Encode(const float* rows, int32_t layer, int32_t head, int which,
                                 uint8_t* page) const {
  const int32_t ps = g_.page_size, d = g_.head_dim;
  if (which == 0) {
    kernels::EncodeTransformKeys(profile_->KeyCode(layer, head), rows, ps,
                                 page + layout_.KCodes(head), layout_.code_bytes,
                                 reinterpret_cast<uint16_t*>(page + layout_.KGains(head)));
  } else {
    const KeyTransformProfile::Head& x = profile_->head(layer, head);
    kernels::DemoteRowsToInt2(rows, ps, d, x.r_v.data(), x.rho_v, layout_.V(page, head));
  }
}

namespace {

class Int2TransformCpuFormat final : public CpuFormat<Int2TransformPageFormat> {
 public:
  using CpuFormat::CpuFormat;

  absl::Status WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                          absl::Span<const int32_t> pages, const PagePool& pool) const override {
    return EncodeRequestPages(geometry(), k, v, first_token, pages, pool,
                              [&](int32_t l, uint8_t* page, int32_t h, int which, float* rows) {
                                transform().Encode(rows, l, h, which, page);
                              });
  }

  // The window stores rows as given.
  absl::Status Demote(const PagePool& window_pool, absl::Span<const int32_t> src_pages,
                      const PagePool& pool, absl::Span<const int32_t> dst_pages) const override {
    EncodeWindowPages(geometry(), window_pool, src_pages, pool, dst_pages,
                      [&](int32_t l, uint8_t* page, int32_t h, int which, float* rows) {
                        transform().Encode(rows, l, h, which, page);
                      });
    return absl::OkStatus();
  }

  void Attend(const PagePool& pool, int32_t layer, absl::Span<const int32_t> page_ids,
              int64_t /*first_position*/, int32_t kv_head, const float* q, int group,
              float softmax_scale, int64_t begin, int64_t end, float* o,
              float* lse) const override {
    kernels::TransformPageTable kv;
    kv.base = pool.LayerBase(layer);
    kv.page_stride = pool.layer_page_bytes();
    kv.page_ids = page_ids.data();
    kv.num_pages = static_cast<int32_t>(page_ids.size());
    kv.layout = transform().layout();
    const KeyTransformProfile& p = transform().profile();
    kernels::AttendTransformPages(kv, kv_head, p.KeyCode(layer, kv_head),
                                  p.head(layer, kv_head).r_v.data(), q, group, softmax_scale, begin,
                                  end, o, lse);
  }
};

}  // namespace

std::unique_ptr<PageFormat> MakeInt2TransformCpuFormat(
    const PageGeometry& geometry, std::shared_ptr<const KeyTransformProfile> profile) {
  return std::make_unique<Int2TransformCpuFormat>(geometry, std::move(profile));
}

}  // namespace kvcd
