// Shared body of the llama runtime's MatMul (llama_matmul.h), included by one translation
// unit per ISA, each compiled with its own target flags and -ffp-contract=off. Written with
// the compiler's generic vectors of eight floats: the compiler emits SSE, AVX2 or AVX-512
// instructions for them as the unit's target allows, and each lane is one of the eight
// partial sums of the summation-order contract. Every template takes the unit's ISA tag
// (llama_matmul.h) first, so that each unit's instantiations are its own symbols (an
// inline function shared by name would let the linker keep one unit's code for all).
// Internal header.
#pragma once

#include <algorithm>
#include <cstdint>

namespace kvcd::llama::internal {

typedef float Lanes8 __attribute__((vector_size(32)));
// Eight floats read at any float's alignment (and through any type).
typedef float Lanes8Unaligned __attribute__((vector_size(32), aligned(4), may_alias));
#define KVCD_LOAD_LANES8(p) (*reinterpret_cast<const Lanes8Unaligned*>(p))

// Outputs of rows w[0 .. R) for tokens x[0 .. T): y[t * ldy + r].
template <class Isa, int R, int T>
inline void MatMulTile(const float* w, const float* x, int in, int64_t ldy, float* y) {
  Lanes8 acc[R][T];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[r][t] = Lanes8{0, 0, 0, 0, 0, 0, 0, 0};
  }
  const int body = in / 8 * 8;
  for (int i = 0; i < body; i += 8) {
    Lanes8 xs[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) xs[t] = KVCD_LOAD_LANES8(x + static_cast<int64_t>(t) * in + i);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Lanes8 ws = KVCD_LOAD_LANES8(w + static_cast<int64_t>(r) * in + i);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) acc[r][t] += ws * xs[t];
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* row = w + static_cast<int64_t>(r) * in;
    for (int t = 0; t < T; ++t) {
      const float* xt = x + static_cast<int64_t>(t) * in;
      float tail = 0;
      for (int i = body; i < in; ++i) tail += row[i] * xt[i];
      const Lanes8& s = acc[r][t];
      y[t * ldy + r] = tail + ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    }
  }
}

// Rows [o0, o1) for tokens [t0, t1) in tiles of R rows x T tokens, the edges in tiles of one.
template <class Isa, int R, int T>
inline void MatMulRows(const float* w, const float* x, int t0, int t1, int o0, int o1, int in,
                       int out, float* y) {
  int t = t0;
  for (; t + T <= t1; t += T) {
    const float* xt = x + static_cast<int64_t>(t) * in;
    float* yt = y + static_cast<int64_t>(t) * out;
    int o = o0;
    for (; o + R <= o1; o += R)
      MatMulTile<Isa, R, T>(w + static_cast<int64_t>(o) * in, xt, in, out, yt + o);
    for (; o < o1; ++o)
      MatMulTile<Isa, 1, T>(w + static_cast<int64_t>(o) * in, xt, in, out, yt + o);
  }
  for (; t < t1; ++t) {
    const float* xt = x + static_cast<int64_t>(t) * in;
    float* yt = y + static_cast<int64_t>(t) * out;
    int o = o0;
    for (; o + R <= o1; o += R)
      MatMulTile<Isa, R, 1>(w + static_cast<int64_t>(o) * in, xt, in, out, yt + o);
    for (; o < o1; ++o)
      MatMulTile<Isa, 1, 1>(w + static_cast<int64_t>(o) * in, xt, in, out, yt + o);
  }
}

// A few tokens (a decode step, a served step with its reference): the weights stream from
// memory one row after another, each row against all the tokens at once (the hardware
// prefetcher follows one sequential stream better than a tile's several rows).
template <class Isa, int T>
void MatMulRowByRow(const float* w, const float* x, int out, int in, float* y) {
  for (int o = 0; o < out; ++o)
    MatMulTile<Isa, 1, T>(w + static_cast<int64_t>(o) * in, x, in, out, y + o);
}

// More tokens: the weights in blocks of rows that stay in the core's cache (about 64 KiB)
// while every token's tile passes over them, so each row comes from memory once per call.
template <class Isa, int R, int T>
void MatMulImpl(const float* w, const float* x, int n, int out, int in, float* y) {
  if (n <= 4) {
    switch (n) {
      case 1:
        return MatMulRowByRow<Isa, 1>(w, x, out, in, y);
      case 2:
        return MatMulRowByRow<Isa, 2>(w, x, out, in, y);
      case 3:
        return MatMulRowByRow<Isa, 3>(w, x, out, in, y);
      case 4:
        return MatMulRowByRow<Isa, 4>(w, x, out, in, y);
      default:
        return;
    }
  }
  const int64_t row_bytes = static_cast<int64_t>(in) * sizeof(float);
  const int block = std::max<int>(R, static_cast<int>((64 << 10) / row_bytes) / R * R);
  for (int o = 0; o < out; o += block) {
    MatMulRows<Isa, R, T>(w, x, 0, n, o, std::min(out, o + block), in, out, y);
  }
}

}  // namespace kvcd::llama::internal
