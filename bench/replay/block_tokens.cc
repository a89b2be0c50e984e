#include "bench/replay/block_tokens.h"

#include "bench/replay/trace.h"

namespace kvcd::replay {

namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

int32_t PageToken(int64_t key, int64_t i) {
  const uint64_t h = Mix(Mix(static_cast<uint64_t>(key)) ^ static_cast<uint64_t>(i));
  return static_cast<int32_t>(h % static_cast<uint64_t>(kReplayVocab));
}

std::vector<int32_t> PageTokens(int64_t key, int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = PageToken(key, i);
  return t;
}

int64_t UniqueKey(int64_t request, int64_t page) { return -1 - ((request << 26) | page); }

int64_t ScaledTokens(int64_t real, int32_t page_size) {
  return (real * page_size + kTraceBlockTokens - 1) / kTraceBlockTokens;
}

}  // namespace kvcd::replay
