// Block identity, version 1 (docs/cluster.md "Block identity"): a page of a model's token
// stream is named by a SHA-256 chained over the pages before it, so the daemon, the
// clients and any other component compute the same name from the model's name, history
// format, tenant (cache_salt) and the token ids, without asking a daemon.
//
//   h_0 = 32 zero bytes
//   h_i = SHA-256("kvcd-block-v1" 0x00 || u32le(|model|) model || u32le(|salt|) salt
//                 || u32le(|format|) format || h_{i-1} || u32le(page_size)
//                 || u32le(token) for each of the page's tokens)
//
// Only full pages have a name. tests/data/block_hash_vectors.json holds vectors written by
// an independent generator (tools/block_hash_vectors.py).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcd {

using BlockHash = std::array<uint8_t, 32>;

// What every block of one model and tenant shares: the inputs of the chain besides the
// parent and the tokens.
struct BlockNamespace {
  std::string model;   // the model's name in the API
  std::string salt;    // the tenant (cache_salt); may be empty
  std::string format;  // the model's history format as its config names it (bf16, fsq, ...)
  uint32_t page_size = 0;
};

// h_0: the parent of page 0.
inline constexpr BlockHash kRootBlockHash{};

// The hash of one page given its parent's hash. `tokens` must hold page_size ids.
BlockHash ChainBlockHash(const BlockNamespace& ns, const BlockHash& parent,
                         absl::Span<const int32_t> tokens);

// The hashes of every full page of `tokens` (a trailing partial page has none), page 0 first.
// Precomputes the namespace prefix once, so a long prompt costs one SHA-256 per page.
std::vector<BlockHash> BlockHashes(const BlockNamespace& ns, absl::Span<const int32_t> tokens);

// Lowercase hex of all 32 bytes (64 characters), the text form in etcd and Redis.
std::string BlockHashHex(const BlockHash& h);
// Parses the text form; INVALID_ARGUMENT unless exactly 64 hex digits.
absl::StatusOr<BlockHash> ParseBlockHashHex(absl::string_view hex);
// The integer id the ZeroMQ events carry: the first 8 bytes as a big-endian signed int64.
int64_t BlockHashEventId(const BlockHash& h);

}  // namespace kvcd
