#include "server/formats/cpu_page_format.h"

#include <vector>

#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"

namespace kvcd {

absl::Status EncodeRequestPages(const PageGeometry& g, const RowSource& k, const RowSource& v,
                                int64_t first_token, absl::Span<const int32_t> pages,
                                const PagePool& pool, const EncodeRows& encode) {
  if (k.on_device || v.on_device) {
    return absl::FailedPreconditionError("the CPU backend cannot read device rows");
  }
  const int32_t ps = g.page_size, d = g.head_dim;
  std::vector<float> rows(static_cast<size_t>(ps) * d);
  for (size_t i = 0; i < pages.size(); ++i) {
    const int64_t src = first_token + static_cast<int64_t>(i) * ps;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      uint8_t* page = pool.PagePtr(l, pages[i]);
      for (int32_t h = 0; h < g.num_kv_heads; ++h) {
        for (int which = 0; which < 2; ++which) {
          const RowSource& in = which == 0 ? k : v;
          for (int32_t t = 0; t < ps; ++t) {
            KVCD_RETURN_IF_ERROR(in.RowAsFloat(l, src + t, h, d, rows.data() + t * d));
          }
          encode(l, page, h, which, rows.data());
        }
      }
    }
  }
  return absl::OkStatus();
}

void EncodeWindowPages(const PageGeometry& g, const PagePool& window_pool,
                       absl::Span<const int32_t> src_pages, const PagePool& pool,
                       absl::Span<const int32_t> dst_pages, const EncodeRows& encode) {
  const int32_t ps = g.page_size, d = g.head_dim;
  std::vector<float> rows(static_cast<size_t>(ps) * d);
  for (size_t i = 0; i < src_pages.size(); ++i) {
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const auto* window = reinterpret_cast<const uint16_t*>(window_pool.PagePtr(l, src_pages[i]));
      uint8_t* page = pool.PagePtr(l, dst_pages[i]);
      for (int32_t h = 0; h < g.num_kv_heads; ++h) {
        for (int which = 0; which < 2; ++which) {
          // Window rows [which][head][slot][d].
          kernels::Bf16ToFloatN(window + (int64_t{which} * g.num_kv_heads + h) * ps * d,
                                rows.data(), int64_t{ps} * d);
          encode(l, page, h, which, rows.data());
        }
      }
    }
  }
}

}  // namespace kvcd
