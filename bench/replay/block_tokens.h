// Deterministic token ids of a replayed trace. A page is keyed by an id: a trace block's hash
// id (>= 0) or a unique id of a request's own output (< 0, see UniqueKey). The tokens of a
// page depend only on its key, so two requests that share a block share its page in the
// daemon's radix tree, and nothing else does (a collision needs page_size equal draws from
// the vocabulary).
#pragma once

#include <cstdint>
#include <vector>

namespace kvcd::replay {

inline constexpr int32_t kReplayVocab = 1 << 30;

// Token `i` of the page keyed `key`, in [0, kReplayVocab).
int32_t PageToken(int64_t key, int64_t i);
// Tokens [0, n) of the page keyed `key` (n = page_size for a full page).
std::vector<int32_t> PageTokens(int64_t key, int32_t n);
// The key of page `page` of request `request`'s own continuation (its output when no later
// request continues its conversation): negative, distinct for every (request, page).
// REQUIRES: 0 <= request < 2^36, 0 <= page < 2^26.
int64_t UniqueKey(int64_t request, int64_t page);

// Tokens of a model whose page holds `page_size` tokens that stand for `real` trace tokens,
// when one 512-token trace block is one page: ceil(real * page_size / 512).
int64_t ScaledTokens(int64_t real, int32_t page_size);

}  // namespace kvcd::replay
