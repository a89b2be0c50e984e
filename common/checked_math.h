// Overflow-safe int64 arithmetic for validating request sizes before allocating.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace kvcd {

// a * b, or nullopt on overflow or when either operand is negative.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  if (a < 0 || b < 0) return std::nullopt;
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// Product of non-negative factors, or nullopt on overflow / negative factor.
inline std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t r = 1;
  for (int64_t f : factors) {
    auto next = CheckedMul(r, f);
    if (!next) return std::nullopt;
    r = *next;
  }
  return r;
}

}  // namespace kvcd
