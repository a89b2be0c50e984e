#include "kvcd/kernels/finite_check.h"

#include <cmath>
#include <cstring>

#include "kvcd/kernels/bf16.h"

namespace kvcd::kernels {
namespace {

// A value is NaN or ±Inf exactly when its exponent bits are all ones (BF16: bits 7..14,
// F32: bits 23..30). Each block is scanned with one flag per lane and no branch (the
// compiler vectorizes the loop: load, and, compare, or); only a block whose flag is set
// is walked again to find the first bad value.
template <typename Word, Word kExponent>
int64_t FirstBad(const uint8_t* bytes, int64_t count) {
  constexpr int64_t kBlock = 2048;
  for (int64_t start = 0; start < count; start += kBlock) {
    const int64_t n = count - start < kBlock ? count - start : kBlock;
    const uint8_t* p = bytes + start * static_cast<int64_t>(sizeof(Word));
    Word any = 0;
    for (int64_t i = 0; i < n; ++i) {
      Word w;
      std::memcpy(&w, p + i * static_cast<int64_t>(sizeof(Word)), sizeof(Word));
      any = static_cast<Word>(any | static_cast<Word>((w & kExponent) == kExponent));
    }
    if (any == 0) continue;
    for (int64_t i = 0; i < n; ++i) {
      Word w;
      std::memcpy(&w, p + i * static_cast<int64_t>(sizeof(Word)), sizeof(Word));
      if ((w & kExponent) == kExponent) return start + i;
    }
  }
  return -1;
}

}  // namespace

int64_t FirstNonFinite(const void* data, int64_t count, bool bf16) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  return bf16 ? FirstBad<uint16_t, 0x7f80u>(bytes, count)
              : FirstBad<uint32_t, 0x7f800000u>(bytes, count);
}

bool CopyBf16AllFinite(const uint16_t* src, uint16_t* dst, int64_t count) {
  uint16_t any = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t h = src[i];
    dst[i] = h;
    any = static_cast<uint16_t>(any | static_cast<uint16_t>((h & 0x7f80u) == 0x7f80u));
  }
  return any == 0;
}

bool AllFinite(const void* data, int64_t count, bool bf16) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  if (bf16) {
    uint16_t any = 0;
    for (int64_t i = 0; i < count; ++i) {
      uint16_t w;
      std::memcpy(&w, bytes + 2 * i, 2);
      any = static_cast<uint16_t>(any | static_cast<uint16_t>((w & 0x7f80u) == 0x7f80u));
    }
    return any == 0;
  }
  uint32_t any = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t w;
    std::memcpy(&w, bytes + 4 * i, 4);
    any |= static_cast<uint32_t>((w & 0x7f800000u) == 0x7f800000u);
  }
  return any == 0;
}

int64_t FirstNonFiniteReference(const void* data, int64_t count, bool bf16) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  for (int64_t i = 0; i < count; ++i) {
    float x;
    if (bf16) {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      x = Bf16ToFloat(h);
    } else {
      std::memcpy(&x, bytes + 4 * i, 4);
    }
    if (!std::isfinite(x)) return i;
  }
  return -1;
}

}  // namespace kvcd::kernels
