// GPT-2-style byte-level BPE tokenizer (SmolLM2, Llama 3, Qwen), read from the text file
// tools/gguf_to_safetensors.py writes (tokenizer.txt: raw-byte vocabulary, ranked merges,
// special tokens, the Unicode letter/number classes of the pre-tokenizer, chat format).
//
// Encoding: special tokens are matched literally first; the text between them is
// pre-tokenized (pre "smollm": every Unicode number on its own, then the GPT-2 split
// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+; pre
// "gpt2": the GPT-2 split alone), and each piece's bytes are merged by merge rank (a byte
// the vocabulary lacks, such as 0x04 in SmolLM2's, becomes the unknown token). No BOS
// is added (the file says add_bos 0 for SmolLM2; other values are refused).
//
// Thread safety: immutable after Load; all methods are const.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcd::llama {

class BpeTokenizer {
 public:
  // NOT_FOUND for a missing file; INVALID_ARGUMENT naming the line that is malformed.
  static absl::StatusOr<BpeTokenizer> Load(const std::string& path);
  static absl::StatusOr<BpeTokenizer> Parse(const std::string& text);

  std::vector<int> Encode(std::string_view text) const;
  // The bytes of the tokens (special tokens as their text); INVALID_ARGUMENT for an id
  // out of range.
  absl::StatusOr<std::string> Decode(const std::vector<int>& ids) const;
  // The bytes of one token (possibly part of a UTF-8 character). REQUIRES: 0 <= id < size.
  const std::string& Piece(int id) const { return tokens_[id]; }

  // One user turn in the model's chat format, ending with the assistant's header
  // (ChatML: the template's default system turn, "<|im_start|>user\n" TEXT
  // "<|im_end|>\n<|im_start|>assistant\n"). FAILED_PRECONDITION without a chat format.
  absl::StatusOr<std::vector<int>> EncodeChat(std::string_view user) const;

  int size() const { return static_cast<int>(tokens_.size()); }
  int eos() const { return eos_; }
  // The id of a token's exact bytes, -1 if none.
  int Find(std::string_view bytes) const;

  // The pre-tokenizer alone (for tests): the pieces BPE runs on, special tokens excluded.
  std::vector<std::string> PreTokenize(std::string_view text) const;

 private:
  bool IsLetter(uint32_t cp) const;
  bool IsNumber(uint32_t cp) const;
  void EncodePiece(std::string_view piece, std::vector<int>* out) const;
  void SplitGpt2(const std::vector<uint32_t>& cps, const std::vector<size_t>& offsets,
                 std::string_view text, std::vector<std::string>* out) const;

  std::vector<std::string> tokens_;
  std::vector<int> special_;      // ids matched literally, longest first
  bool special_first_[256] = {};  // bytes that begin a special token
  std::unordered_map<std::string, int> index_;
  std::unordered_map<uint64_t, std::pair<int, int>> merges_;  // (a, b) -> (rank, merged id)
  int byte_token_[256] = {};
  std::vector<std::pair<uint32_t, uint32_t>> letters_, numbers_;  // sorted inclusive ranges
  bool split_digits_ = false;
  int eos_ = -1;
  std::string chat_, default_system_;
};

}  // namespace kvcd::llama
