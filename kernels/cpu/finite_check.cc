#include "kvcd/kernels/finite_check.h"

#include <cmath>
#include <cstring>

#include "kvcd/kernels/bf16.h"

namespace kvcd::kernels {
namespace {

// A value is NaN or ±Inf exactly when its exponent bits are all ones (BF16: bits 7..14,
// F32: bits 23..30).
template <typename Word, Word kExponent>
int64_t FirstBad(const uint8_t* bytes, int64_t count) {
  constexpr int64_t kBlock = 256;
  for (int64_t start = 0; start < count; start += kBlock) {
    const int64_t n = count - start < kBlock ? count - start : kBlock;
    Word words[kBlock];
    std::memcpy(words, bytes + start * static_cast<int64_t>(sizeof(Word)),
                static_cast<size_t>(n) * sizeof(Word));
    uint32_t any = 0;
    for (int64_t i = 0; i < n; ++i) {
      any |= static_cast<uint32_t>((words[i] & kExponent) == kExponent);
    }
    if (any == 0) continue;
    for (int64_t i = 0; i < n; ++i) {
      if ((words[i] & kExponent) == kExponent) return start + i;
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
