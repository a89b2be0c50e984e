// The tokenizer of llama2.c checkpoints (tokenizer.bin / tok512.bin: a max piece length,
// then per token a float score, an int32 length and the piece bytes): SentencePiece-style
// BPE by merge score, with BOS = 1 and a dummy-prefix space.
//
// Thread safety: immutable after Load.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcd::llama {

class Llama2cTokenizer {
 public:
  // NOT_FOUND for a missing file; INVALID_ARGUMENT for a truncated one or a bad entry.
  static absl::StatusOr<Llama2cTokenizer> Load(const std::string& path, int vocab_size);
  // llama2.c encoding: BOS, a dummy-prefix space, the code points (bytes as <0xXX> tokens
  // 3 + byte when a code point has no piece), then BPE merges by score.
  std::vector<int> Encode(const std::string& text) const;
  // The piece of `token` following `prev` (leading space stripped after BOS; <0xXX> bytes).
  std::string Piece(int prev, int token) const;
  // The text of `tokens` following `prev` (pieces concatenated).
  std::string Decode(int prev, const std::vector<int>& tokens) const;
  int vocab_size() const { return static_cast<int>(vocab_.size()); }

 private:
  std::vector<std::string> vocab_;
  std::vector<float> scores_;
};

}  // namespace kvcd::llama
