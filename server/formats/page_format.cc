#include "server/formats/page_format.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/finite_check.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd {

std::vector<RowSlot> PageRowSlots(int64_t first_token, absl::Span<const int32_t> pages,
                                  int32_t page_size) {
  std::vector<RowSlot> rows;
  rows.reserve(pages.size() * static_cast<size_t>(page_size));
  for (size_t i = 0; i < pages.size(); ++i) {
    for (int32_t t = 0; t < page_size; ++t) {
      rows.push_back({first_token + static_cast<int64_t>(i) * page_size + t, pages[i], t});
    }
  }
  return rows;
}

absl::Status RowSource::CheckRow(const void* row, int64_t offset, int32_t head_dim) const {
  // Only for a row known to hold a NaN/Inf: find and name the first one.
  const int64_t j = kernels::FirstNonFinite(row, head_dim, is_bf16);
  float x = 0;
  if (is_bf16) {
    uint16_t h;
    std::memcpy(&h, static_cast<const uint16_t*>(row) + j, 2);
    x = kernels::Bf16ToFloat(h);
  } else {
    std::memcpy(&x, static_cast<const float*>(row) + j, 4);
  }
  return absl::InvalidArgumentError(absl::StrCat(name, "[", offset + j, "] (flat index, ",
                                                 is_bf16 ? "BF16" : "F32", ") is ",
                                                 std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf"),
                                                 "; expected finite values (nothing was stored)"));
}

absl::Status RowSource::RowAsFloat(int64_t layer, int64_t token, int32_t head, int32_t head_dim,
                                   float* out) const {
  const int64_t off = layer * layer_stride + token * token_stride + int64_t{head} * head_dim;
  if (is_bf16) {
    const uint16_t* row = static_cast<const uint16_t*>(data) + off;
    kernels::Bf16ToFloatN(row, out, head_dim);
    if (check_finite && !kernels::AllFinite(row, head_dim, true))
      return CheckRow(row, off, head_dim);
  } else {
    const float* row = static_cast<const float*>(data) + off;
    std::memcpy(out, row, sizeof(float) * head_dim);
    if (check_finite && !kernels::AllFinite(out, head_dim, false))
      return CheckRow(row, off, head_dim);
  }
  return absl::OkStatus();
}

absl::Status RowSource::RowAsBf16(int64_t layer, int64_t token, int32_t head, int32_t head_dim,
                                  uint16_t* out) const {
  const int64_t off = layer * layer_stride + token * token_stride + int64_t{head} * head_dim;
  if (is_bf16) {
    const uint16_t* row = static_cast<const uint16_t*>(data) + off;
    if (!check_finite) {
      std::memcpy(out, row, sizeof(uint16_t) * head_dim);
      return absl::OkStatus();
    }
    // The copy and the check in one loop: each value is read once.
    if (!kernels::CopyBf16AllFinite(row, out, head_dim)) return CheckRow(row, off, head_dim);
  } else {
    const float* row = static_cast<const float*>(data) + off;
    kernels::FloatToBf16N(row, out, head_dim);
    if (check_finite && !kernels::AllFinite(row, head_dim, false))
      return CheckRow(row, off, head_dim);
  }
  return absl::OkStatus();
}

absl::Status PageFormat::WriteRows(const RowSource&, const RowSource&, absl::Span<const RowSlot>,
                                   int32_t, const PagePool&) const {
  return absl::UnimplementedError(
      absl::StrCat(name(), " pages are written whole; single rows go to the window format"));
}

absl::Status PageFormat::WriteCodes(const RowSource&, absl::Span<const RowSlot>, int32_t,
                                    const PagePool&) const {
  return absl::UnimplementedError(absl::StrCat(name(), " pages store no residual codes"));
}

absl::Status PageFormat::Demote(const PagePool&, absl::Span<const int32_t>, const PagePool&,
                                absl::Span<const int32_t>) const {
  return absl::UnimplementedError(absl::StrCat(name(), " is not a history format"));
}

absl::Status PageFormat::CheckDevicePages(const uint8_t*, int64_t, int64_t) const {
  return absl::FailedPreconditionError(
      "this backend has no device memory; send pages inline (inline_pages)");
}

void PageFormat::Unrotate(int32_t layer, int which, int32_t count, float* rows) const {
  if (rotation_ == nullptr) return;
  const int32_t d = geometry_.head_dim;
  std::vector<float> rotated(rows, rows + int64_t{count} * d);
  kernels::RotateRows(rotated.data(), count, d,
                      which == 0 ? rotation_->RKT(layer) : rotation_->RVT(layer), rows);
}

}  // namespace kvcd
