#include "examples/bpe_tokenizer.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvcd::llama {
namespace {

absl::StatusOr<std::string> FromHex(absl::string_view hex) {
  if (hex.size() % 2 != 0) return absl::InvalidArgumentError("odd-length hex string");
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    int v = 0;
    for (int j = 0; j < 2; ++j) {
      const char ch = hex[2 * i + j];
      int n = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
      if (n < 0) return absl::InvalidArgumentError(absl::StrCat("bad hex digit at ", 2 * i + j));
      v = v * 16 + n;
    }
    out[i] = static_cast<char>(v);
  }
  return out;
}

// Decodes UTF-8 into code points with the byte offset of each (offsets has one more
// entry: the end). A malformed byte becomes a code point of its own (U+FFFD class).
void DecodeUtf8(std::string_view s, std::vector<uint32_t>* cps, std::vector<size_t>* offsets) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    uint32_t cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
    bool ok = len > 0 && i + len <= s.size();
    for (int j = 1; ok && j < len; ++j) {
      const auto c = static_cast<unsigned char>(s[i + j]);
      ok = (c & 0xC0) == 0x80;
      cp = (cp << 6) | (c & 0x3F);
    }
    offsets->push_back(i);
    if (!ok) {
      cps->push_back(0xFFFD);
      i += 1;
    } else {
      cps->push_back(cp);
      i += len;
    }
  }
  offsets->push_back(s.size());
}

bool InRanges(const std::vector<std::pair<uint32_t, uint32_t>>& r, uint32_t cp) {
  auto it = std::upper_bound(r.begin(), r.end(),
                             std::make_pair(cp, std::numeric_limits<uint32_t>::max()));
  return it != r.begin() && std::prev(it)->second >= cp;
}

// Unicode White_Space (what \s matches in the pre-tokenizer's regex).
bool IsSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

uint64_t PairKey(int a, int b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

absl::StatusOr<BpeTokenizer> BpeTokenizer::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open tokenizer '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto t = Parse(ss.str());
  if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", t.status().message()));
  return t;
}

absl::StatusOr<BpeTokenizer> BpeTokenizer::Parse(const std::string& text) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  size_t at = 0;
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("line ", at, ": ", what));
  };
  // The next line as "key value..." fields.
  auto next = [&](std::vector<absl::string_view>* f) {
    if (at >= lines.size()) return false;
    *f = absl::StrSplit(lines[at++], ' ');
    return true;
  };
  auto count = [&](absl::string_view key, int64_t max, int64_t* n) -> absl::Status {
    std::vector<absl::string_view> f;
    if (!next(&f) || f.size() != 2 || f[0] != key || !absl::SimpleAtoi(f[1], n) || *n < 0 ||
        *n > max) {
      return bad(absl::StrCat("expected '", key, " N' with N in [0, ", max, "]"));
    }
    return absl::OkStatus();
  };
  BpeTokenizer t;
  std::vector<absl::string_view> f;
  if (!next(&f) || lines[0] != "kvcd-bpe-tokenizer 1") {
    return bad("expected the header 'kvcd-bpe-tokenizer 1'");
  }
  if (!next(&f) || f.size() != 2 || f[0] != "pre" || (f[1] != "smollm" && f[1] != "gpt2")) {
    return bad("expected 'pre smollm' or 'pre gpt2' (the pre-tokenizers implemented)");
  }
  t.split_digits_ = f[1] == "smollm";
  if (!next(&f) || f.size() != 2 || f[0] != "add_bos" || f[1] != "0") {
    return bad("expected 'add_bos 0' (BOS-prefixed encodings are not implemented)");
  }
  int64_t bos = 0, eos = 0, unk = 0, n = 0;
  if (!next(&f) || f.size() != 2 || f[0] != "bos" || !absl::SimpleAtoi(f[1], &bos)) {
    return bad("expected 'bos ID'");
  }
  if (!next(&f) || f.size() != 2 || f[0] != "eos" || !absl::SimpleAtoi(f[1], &eos)) {
    return bad("expected 'eos ID'");
  }
  if (!next(&f) || f.size() != 2 || f[0] != "unknown" || !absl::SimpleAtoi(f[1], &unk)) {
    return bad("expected 'unknown ID' (-1: none)");
  }
  if (auto s = count("tokens", 1 << 22, &n); !s.ok()) return s;
  std::fill(std::begin(t.byte_token_), std::end(t.byte_token_), -1);
  for (int64_t i = 0; i < n; ++i) {
    if (!next(&f) || f.size() != 2 || (f[0] != "n" && f[0] != "s")) {
      return bad("expected a token 'n HEX' or 's HEX'");
    }
    auto bytes = FromHex(f[1]);
    if (!bytes.ok() || bytes->empty()) return bad("token bytes: expected non-empty lowercase hex");
    const int id = static_cast<int>(i);
    if (f[0] == "s") {
      t.special_.push_back(id);
    } else if (bytes->size() == 1) {
      t.byte_token_[static_cast<unsigned char>((*bytes)[0])] = id;
    }
    if (f[0] == "n") t.index_.emplace(*bytes, id);
    t.tokens_.push_back(std::move(*bytes));
  }
  if (eos < 0 || eos >= n || bos < -1 || bos >= n || unk < -1 || unk >= n) {
    return bad("bos / eos / unknown out of range");
  }
  t.eos_ = static_cast<int>(eos);
  for (int b = 0; b < 256; ++b) {  // bytes without a token (never in text) become unknown
    if (t.byte_token_[b] < 0) t.byte_token_[b] = static_cast<int>(unk);
  }
  for (int id : t.special_) t.special_first_[static_cast<unsigned char>(t.tokens_[id][0])] = true;
  std::sort(t.special_.begin(), t.special_.end(),
            [&](int a, int b) { return t.tokens_[a].size() > t.tokens_[b].size(); });
  if (auto s = count("merges", 1 << 22, &n); !s.ok()) return s;
  for (int64_t i = 0; i < n; ++i) {
    int64_t a = 0, b = 0, ab = 0;
    const int64_t size = static_cast<int64_t>(t.tokens_.size());
    if (!next(&f) || f.size() != 3 || !absl::SimpleAtoi(f[0], &a) || !absl::SimpleAtoi(f[1], &b) ||
        !absl::SimpleAtoi(f[2], &ab) || a < 0 || b < 0 || ab < 0 || a >= size || b >= size ||
        ab >= size || t.tokens_[a] + t.tokens_[b] != t.tokens_[ab]) {
      return bad("expected a merge 'A B AB' of token ids whose bytes concatenate");
    }
    t.merges_.emplace(PairKey(static_cast<int>(a), static_cast<int>(b)),
                      std::make_pair(static_cast<int>(i), static_cast<int>(ab)));
  }
  for (auto* ranges : {&t.letters_, &t.numbers_}) {
    std::vector<absl::string_view> head;
    if (!next(&head) || head.size() != 2 ||
        head[0] != (ranges == &t.letters_ ? "letters" : "numbers") ||
        !absl::SimpleAtoi(head[1], &n) || n < 0 || n > 0x110000) {
      return bad("expected 'letters N' / 'numbers N'");
    }
    uint32_t prev_hi = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t lo = 0, hi = 0;
      if (!next(&f) || f.size() != 2 || !absl::SimpleHexAtoi(f[0], &lo) ||
          !absl::SimpleHexAtoi(f[1], &hi) || lo > hi || hi > 0x10FFFF || (i > 0 && lo <= prev_hi)) {
        return bad("expected a sorted code point range 'LO HI' (hex)");
      }
      prev_hi = hi;
      ranges->emplace_back(lo, hi);
    }
  }
  if (!next(&f) || f.size() != 2 || f[0] != "chat" || (f[1] != "chatml" && f[1] != "none")) {
    return bad("expected 'chat chatml' or 'chat none'");
  }
  t.chat_ = std::string(f[1]);
  if (t.chat_ == "chatml") {
    if (!next(&f) || f.size() != 2 || f[0] != "default_system") {
      return bad("expected 'default_system HEX'");
    }
    auto sys = FromHex(f[1]);
    if (!sys.ok()) return bad("default_system: expected hex");
    t.default_system_ = std::move(*sys);
    if (t.Find("<|im_start|>") < 0 || t.Find("<|im_end|>") < 0) {
      return bad("chat chatml without <|im_start|> / <|im_end|> special tokens");
    }
  }
  if (!next(&f) || f.size() != 2 || f[0] != "chat_template")
    return bad("expected 'chat_template HEX'");
  if (!next(&f) || lines[at - 1] != "end") return bad("expected 'end'");
  return t;
}

int BpeTokenizer::Find(std::string_view bytes) const {
  auto it = index_.find(std::string(bytes));
  if (it != index_.end()) return it->second;
  for (int id : special_) {
    if (tokens_[id] == bytes) return id;
  }
  return -1;
}

bool BpeTokenizer::IsLetter(uint32_t cp) const { return InRanges(letters_, cp); }
bool BpeTokenizer::IsNumber(uint32_t cp) const { return InRanges(numbers_, cp); }

// The GPT-2 split on one segment (code points cps with byte offsets into text).
void BpeTokenizer::SplitGpt2(const std::vector<uint32_t>& cps, const std::vector<size_t>& offsets,
                             std::string_view text, std::vector<std::string>* out) const {
  const size_t n = cps.size();
  auto emit = [&](size_t b, size_t e) {
    out->emplace_back(text.substr(offsets[b], offsets[e] - offsets[b]));
  };
  auto other = [&](uint32_t cp) { return !IsSpace(cp) && !IsLetter(cp) && !IsNumber(cp); };
  for (size_t i = 0; i < n;) {
    // 's 't 're 've 'm 'll 'd (case-sensitive, as in GPT-2).
    if (cps[i] == '\'' && i + 1 < n) {
      const uint32_t a = cps[i + 1], b = i + 2 < n ? cps[i + 2] : 0;
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
      if (len > 0) {
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
    size_t j = i + (cps[i] == ' ' && i + 1 < n && !IsSpace(cps[i + 1]) ? 1 : 0);
    if (!IsSpace(cps[j])) {
      bool (BpeTokenizer::*cls)(uint32_t) const = nullptr;
      if (IsLetter(cps[j])) cls = &BpeTokenizer::IsLetter;
      if (IsNumber(cps[j])) cls = &BpeTokenizer::IsNumber;
      size_t e = j + 1;
      while (e < n && (cls != nullptr ? (this->*cls)(cps[e]) : other(cps[e]))) ++e;
      emit(i, e);
      i = e;
      continue;
    }
    // '\s+(?!\S)' then '\s+': a run of spaces gives up its last one to a following word.
    size_t e = i;
    while (e < n && IsSpace(cps[e])) ++e;
    if (e < n && e - i > 1) --e;
    emit(i, e);
    i = e;
  }
}

std::vector<std::string> BpeTokenizer::PreTokenize(std::string_view text) const {
  std::vector<uint32_t> cps;
  std::vector<size_t> offsets;
  DecodeUtf8(text, &cps, &offsets);
  std::vector<std::string> out;
  // Segments between isolated numbers (pre "smollm": each \p{N} is its own piece).
  size_t start = 0;
  auto flush = [&](size_t end) {
    if (end <= start) return;
    std::vector<uint32_t> seg(cps.begin() + start, cps.begin() + end);
    std::vector<size_t> off(offsets.begin() + start, offsets.begin() + end + 1);
    SplitGpt2(seg, off, text, &out);
  };
  for (size_t i = 0; i < cps.size(); ++i) {
    if (split_digits_ && IsNumber(cps[i])) {
      flush(i);
      out.emplace_back(text.substr(offsets[i], offsets[i + 1] - offsets[i]));
      start = i + 1;
    }
  }
  flush(cps.size());
  return out;
}

void BpeTokenizer::EncodePiece(std::string_view piece, std::vector<int>* out) const {
  std::vector<int> ids;
  ids.reserve(piece.size());
  for (char ch : piece) {
    const int id = byte_token_[static_cast<unsigned char>(ch)];
    if (id >= 0) ids.push_back(id);  // a byte with no token and no unknown token is dropped
  }
  // Repeatedly merge the adjacent pair of lowest rank (leftmost on ties).
  for (;;) {
    int best_rank = std::numeric_limits<int>::max(), best_at = -1, best_id = -1;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      auto it = merges_.find(PairKey(ids[i], ids[i + 1]));
      if (it != merges_.end() && it->second.first < best_rank) {
        best_rank = it->second.first;
        best_at = static_cast<int>(i);
        best_id = it->second.second;
      }
    }
    if (best_at < 0) break;
    ids[best_at] = best_id;
    ids.erase(ids.begin() + best_at + 1);
  }
  out->insert(out->end(), ids.begin(), ids.end());
}

std::vector<int> BpeTokenizer::Encode(std::string_view text) const {
  std::vector<int> out;
  size_t start = 0;
  auto encode_plain = [&](size_t end) {
    for (const std::string& piece : PreTokenize(text.substr(start, end - start))) {
      EncodePiece(piece, &out);
    }
  };
  for (size_t i = 0; i < text.size();) {
    int hit = -1;
    if (special_first_[static_cast<unsigned char>(text[i])]) {
      for (int id : special_) {
        if (text.compare(i, tokens_[id].size(), tokens_[id]) == 0) {
          hit = id;
          break;
        }
      }
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    encode_plain(i);
    out.push_back(hit);
    i += tokens_[hit].size();
    start = i;
  }
  encode_plain(text.size());
  return out;
}

absl::StatusOr<std::string> BpeTokenizer::Decode(const std::vector<int>& ids) const {
  std::string out;
  for (int id : ids) {
    if (id < 0 || id >= size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " out of range [0, ", size(), ")"));
    }
    out += tokens_[id];
  }
  return out;
}

absl::StatusOr<std::vector<int>> BpeTokenizer::EncodeChat(std::string_view user) const {
  if (chat_ != "chatml") {
    return absl::FailedPreconditionError("this tokenizer has no chat format");
  }
  std::string text;
  if (!default_system_.empty()) {
    absl::StrAppend(&text, "<|im_start|>system\n", default_system_, "<|im_end|>\n");
  }
  absl::StrAppend(&text, "<|im_start|>user\n", std::string(user),
                  "<|im_end|>\n<|im_start|>assistant\n");
  return Encode(text);
}

}  // namespace kvcd::llama
