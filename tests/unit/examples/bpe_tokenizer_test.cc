#include "examples/bpe_tokenizer.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace kvcd::llama {
namespace bpe_tokenizer_test {

std::string Hex(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) absl::StrAppend(&out, absl::Hex(ch, absl::kZeroPad2));
  return out;
}

// A hand-made vocabulary: ids 0..255 the single bytes, 256/257 <|im_start|>/<|im_end|>,
// then merged tokens with the ranks listed below.
std::string SmallTokenizerText(const std::string& pre = "smollm") {
  std::string t = absl::StrCat("kvcd-bpe-tokenizer 1\npre ", pre,
                               "\nadd_bos 0\nbos 256\neos 257\nunknown -1\n");
  const std::vector<std::string> merged = {"he", "ll", "lo", "hell", "hello", " w", " wo"};
  absl::StrAppend(&t, "tokens ", 258 + merged.size(), "\n");
  for (int b = 0; b < 256; ++b)
    absl::StrAppend(&t, "n ", Hex(std::string(1, static_cast<char>(b))), "\n");
  absl::StrAppend(&t, "s ", Hex("<|im_start|>"), "\ns ", Hex("<|im_end|>"), "\n");
  for (const auto& m : merged) absl::StrAppend(&t, "n ", Hex(m), "\n");
  // rank 0: h e -> 258, 1: l l -> 259, 2: l o -> 260, 3: he ll -> 261, 4: hell o -> 262,
  // 5: ' ' w -> 263, 6: ' w' o -> 264
  absl::StrAppend(&t, "merges 7\n", int{'h'}, " ", int{'e'}, " 258\n", int{'l'}, " ", int{'l'},
                  " 259\n", int{'l'}, " ", int{'o'}, " 260\n258 259 261\n261 ", int{'o'}, " 262\n",
                  int{' '}, " ", int{'w'}, " 263\n263 ", int{'o'}, " 264\n");
  // Letters: ASCII letters and U+00C0..U+00FF; numbers: ASCII and Arabic-Indic digits.
  absl::StrAppend(&t, "letters 3\n41 5a\n61 7a\nc0 ff\nnumbers 2\n30 39\n660 669\n");
  absl::StrAppend(&t, "chat chatml\ndefault_system ", Hex("Be brief."),
                  "\nchat_template 00\nend\n");
  return t;
}

BpeTokenizer Small(const std::string& pre = "smollm") {
  auto t = BpeTokenizer::Parse(SmallTokenizerText(pre));
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

TEST(BpeTokenizerTest, MergesByRank) {
  BpeTokenizer t = Small();
  // h e l l o: he (rank 0), ll (1) before lo (2), he+ll (3), hell+o (4).
  EXPECT_EQ(t.Encode("hello"), std::vector<int>({262}));
  // h e l o: he, then lo; "he lo" is no merge.
  EXPECT_EQ(t.Encode("helo"), std::vector<int>({258, 260}));
  // " world" is one pre-token: ' '+w, then ' w'+o, the rest stay bytes.
  EXPECT_EQ(t.Encode(" world"), std::vector<int>({264, 'r', 'l', 'd'}));
  EXPECT_EQ(t.Encode("hello world"), std::vector<int>({262, 264, 'r', 'l', 'd'}));
}

TEST(BpeTokenizerTest, PreTokenizerFollowsTheGpt2SplitAndIsolatesDigits) {
  BpeTokenizer t = Small();
  using V = std::vector<std::string>;
  EXPECT_EQ(t.PreTokenize("Hello world"), V({"Hello", " world"}));
  EXPECT_EQ(t.PreTokenize("abc123 45"), V({"abc", "1", "2", "3", " ", "4", "5"}));
  EXPECT_EQ(t.PreTokenize("I'm  fine\n\nok"), V({"I", "'m", " ", " fine", "\n", "\n", "ok"}));
  EXPECT_EQ(t.PreTokenize("we'll they're"), V({"we", "'ll", " they", "'re"}));
  EXPECT_EQ(t.PreTokenize("a, b!? x  "), V({"a", ",", " b", "!?", " x", "  "}));
  // U+00E9 is a letter, U+0661 a number, U+4E2D (not in this file's classes) other.
  EXPECT_EQ(t.PreTokenize("caf\xc3\xa9\xd9\xa1 \xe4\xb8\xad!"),
            V({"caf\xc3\xa9", "\xd9\xa1", " \xe4\xb8\xad!"}));
  // Without digit isolation ("gpt2"), numbers group.
  EXPECT_EQ(Small("gpt2").PreTokenize("abc123 45"), V({"abc", "123", " 45"}));
}

TEST(BpeTokenizerTest, NonAsciiBytesAndSpecialTokens) {
  BpeTokenizer t = Small();
  EXPECT_EQ(t.Encode("\xc3\xa9"), std::vector<int>({0xc3, 0xa9}));
  EXPECT_EQ(t.Encode("<|im_start|>he<|im_end|>"), std::vector<int>({256, 258, 257}));
  EXPECT_EQ(t.Encode("<|im_sta"), std::vector<int>({'<', '|', 'i', 'm', '_', 's', 't', 'a'}));
  auto chat = t.EncodeChat("hello");
  ASSERT_TRUE(chat.ok());
  auto text = t.Decode(*chat);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ((*chat)[0], 256);
  const std::string s = "x \xff\xfe y\xc3\xa9\xd9\xa1 hello  world\n";
  auto round = t.Decode(t.Encode(s));
  ASSERT_TRUE(round.ok());
  EXPECT_EQ(*round, s);
  EXPECT_EQ(t.Decode({-1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Decode({258 + 7}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BpeTokenizerTest, RejectsMalformedFiles) {
  const std::string good = SmallTokenizerText();
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  const std::vector<std::string> bad = {
      replace("kvcd-bpe-tokenizer 1", "kvcd-bpe-tokenizer 2"),
      replace("pre smollm", "pre llama3"),
      replace("add_bos 0", "add_bos 1"),
      replace("258 259 261", "258 259 262"),  // bytes do not concatenate
      replace("258 259 261", "258 259 9999"),
      replace("letters 3\n41 5a\n61 7a", "letters 3\n61 7a\n41 5a"),  // unsorted
      replace("n 00\n", "n 0g\n"),
      replace("chat chatml", "chat jinja"),
      good.substr(0, good.size() / 2),
  };
  for (const auto& text : bad) {
    auto t = BpeTokenizer::Parse(text);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << text.substr(0, 80);
    EXPECT_NE(t.status().message().find("line "), std::string::npos) << t.status();
  }
  EXPECT_EQ(BpeTokenizer::Load("/nonexistent/tokenizer.txt").status().code(),
            absl::StatusCode::kNotFound);
}

// The SmolLM2 vocabulary (scripts/fetch-smollm2.sh); ids checked against its token list.
class SmolLm2TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("KVCD_MODEL_CACHE");
    const std::string dir = std::string(env != nullptr ? env : KVCD_MODEL_CACHE) +
                            "/smollm2-135m-instruct/tokenizer.txt";
    if (!std::ifstream(dir).good()) GTEST_SKIP() << "run scripts/fetch-smollm2.sh (" << dir << ")";
    auto t = BpeTokenizer::Load(dir);
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::make_unique<BpeTokenizer>(std::move(*t));
  }
  std::unique_ptr<BpeTokenizer> tok_;
};

TEST_F(SmolLm2TokenizerTest, KnownIds) {
  // Whole words in the vocabulary: "The"=504, " capital"=3575, " of"=282, " France"=4649,
  // " is"=314; no BOS.
  EXPECT_EQ(tok_->Encode("The capital of France is"),
            std::vector<int>({504, 3575, 282, 4649, 314}));
  EXPECT_EQ(tok_->Find(" Paris"), 7042);
  // Digits one by one ("2"=34, "0"=32, "4"=36), the space before them on its own (216).
  EXPECT_EQ(tok_->Encode(" 2024"), std::vector<int>({216, 34, 32, 34, 36}));
  // "é" (c3 a9) is token 2756; "\n"=198.
  EXPECT_EQ(tok_->Encode("\xc3\xa9\n"), std::vector<int>({2756, 198}));
  EXPECT_EQ(tok_->Encode("Hello world"), std::vector<int>({19556, 905}));
  EXPECT_EQ(tok_->eos(), 2);
  // Byte 0x04 has no token in this vocabulary: the unknown token (0, <|endoftext|>).
  EXPECT_EQ(tok_->Encode("a\x04"), std::vector<int>({81, 0}));
  const std::string s = "na\xc3\xafve caf\xc3\xa9 \xe6\x9d\xb1\xe4\xba\xac, 3.14 isn't  it?\n";
  auto round = tok_->Decode(tok_->Encode(s));
  ASSERT_TRUE(round.ok());
  EXPECT_EQ(*round, s);
}

TEST_F(SmolLm2TokenizerTest, ChatTemplate) {
  auto ids = tok_->EncodeChat("Hi");
  ASSERT_TRUE(ids.ok()) << ids.status();
  auto text = tok_->Decode(*ids);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(ids->front(), 1);  // <|im_start|>
  // "...<|im_end|>\n<|im_start|>assistant\n": special ids 2 and 1 matched, not spelled out.
  int specials = 0;
  for (int id : *ids) specials += id == 1 || id == 2;
  EXPECT_EQ(specials, 5);
}

}  // namespace bpe_tokenizer_test
}  // namespace kvcd::llama
