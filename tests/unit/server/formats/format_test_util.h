// Helpers shared by the page format tests: a page pool over host memory, random rows and
// the RowSource over them.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kvcd/kernels/bf16.h"
#include "server/formats/page_format.h"
#include "server/formats/page_pool.h"

namespace kvcd::format_test {

// `pages` pages of layer_bytes per layer, every byte `fill`.
struct TestPool {
  TestPool(const PageGeometry& g, int64_t layer_bytes, int32_t pages, uint8_t fill = 0)
      : mem(static_cast<size_t>(layer_bytes * pages * g.num_layers), fill),
        pool("test", mem.data(), g.num_layers, layer_bytes, pages) {}
  // A pool of the format's pages.
  TestPool(const PageFormat& f, int32_t pages, uint8_t fill = 0)
      : TestPool(f.geometry(), f.layer_page_bytes(), pages, fill) {}
  std::vector<uint8_t> mem;
  PagePool pool;
};

// n values of N(mean, stddev^2), as float or as BF16.
inline std::vector<float> RandomFloats(int64_t n, uint32_t seed, float mean = 0.0f,
                                       float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = mean + stddev * normal(rng);
  return x;
}
inline std::vector<uint16_t> RandomBf16(int64_t n, uint32_t seed, float mean = 0.0f,
                                        float stddev = 1.0f) {
  const std::vector<float> f = RandomFloats(n, seed, mean, stddev);
  std::vector<uint16_t> x(f.size());
  for (size_t i = 0; i < f.size(); ++i) x[i] = kernels::FloatToBf16(f[i]);
  return x;
}

// Host rows [layers][tokens][row] (row: the values of one token, e.g. kv heads x head_dim).
inline RowSource F32Rows(const std::vector<float>& x, int64_t tokens, int64_t row) {
  RowSource r;
  r.data = x.data();
  r.is_bf16 = false;
  r.token_stride = row;
  r.layer_stride = tokens * row;
  return r;
}
inline RowSource Bf16Rows(const std::vector<uint16_t>& x, int64_t tokens, int64_t row) {
  RowSource r;
  r.data = x.data();
  r.is_bf16 = true;
  r.token_stride = row;
  r.layer_stride = tokens * row;
  return r;
}

// Values per token of one layer: K or V rows of every KV head.
inline int64_t KvRow(const PageGeometry& g) { return int64_t{g.num_kv_heads} * g.head_dim; }

}  // namespace kvcd::format_test
