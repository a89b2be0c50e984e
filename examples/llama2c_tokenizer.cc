#include "examples/llama2c_tokenizer.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"

namespace kvcd::llama {

absl::StatusOr<Llama2cTokenizer> Llama2cTokenizer::Load(const std::string& path, int vocab_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open tokenizer '", path, "'"));
  int32_t max_len = 0;
  in.read(reinterpret_cast<char*>(&max_len), 4);
  Llama2cTokenizer t;
  for (int i = 0; i < vocab_size; ++i) {
    float score = 0;
    int32_t len = 0;
    in.read(reinterpret_cast<char*>(&score), 4);
    in.read(reinterpret_cast<char*>(&len), 4);
    if (!in || len < 0 || len > 1024) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad entry ", i));
    }
    std::string s(static_cast<size_t>(len), '\0');
    in.read(s.data(), len);
    t.vocab_.push_back(std::move(s));
    t.scores_.push_back(score);
  }
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": truncated"));
  return t;
}

std::vector<int> Llama2cTokenizer::Encode(const std::string& text) const {
  std::map<std::string, int> index;
  for (int i = 0; i < static_cast<int>(vocab_.size()); ++i) index.emplace(vocab_[i], i);
  std::vector<int> tokens = {1};  // BOS
  if (text.empty()) return tokens;
  std::vector<int> t;
  const std::string s = " " + text;  // dummy prefix
  for (size_t i = 0; i < s.size();) {
    size_t len = 1;  // one UTF-8 code point
    while (i + len < s.size() && (static_cast<unsigned char>(s[i + len]) & 0xC0) == 0x80) ++len;
    auto it = index.find(s.substr(i, len));
    if (it != index.end()) {
      t.push_back(it->second);
    } else {
      for (size_t b = 0; b < len; ++b) t.push_back(static_cast<unsigned char>(s[i + b]) + 3);
    }
    i += len;
  }
  for (;;) {  // merge the best-scoring adjacent pair
    float best = -1e10f;
    int best_id = -1, best_at = -1;
    for (size_t i = 0; i + 1 < t.size(); ++i) {
      auto it = index.find(vocab_[t[i]] + vocab_[t[i + 1]]);
      if (it != index.end() && scores_[it->second] > best) {
        best = scores_[it->second];
        best_id = it->second;
        best_at = static_cast<int>(i);
      }
    }
    if (best_at < 0) break;
    t[best_at] = best_id;
    t.erase(t.begin() + best_at + 1);
  }
  tokens.insert(tokens.end(), t.begin(), t.end());
  return tokens;
}

std::string Llama2cTokenizer::Piece(int prev, int token) const {
  if (token < 0 || token >= vocab_size()) return "<?>";
  std::string p = vocab_[token];
  if (prev == 1 && !p.empty() && p[0] == ' ') p.erase(0, 1);
  unsigned byte = 0;
  if (p.size() == 6 && std::sscanf(p.c_str(), "<0x%02X>", &byte) == 1)
    return std::string(1, static_cast<char>(byte));
  return p;
}

std::string Llama2cTokenizer::Decode(int prev, const std::vector<int>& tokens) const {
  std::string text;
  for (int t : tokens) {
    text += Piece(prev, t);
    prev = t;
  }
  return text;
}

}  // namespace kvcd::llama
