// Tokens file parsing, bearer-token authentication and the reloading token store.
#include "server/rpc/auth.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace kvcd {
namespace auth_test {

std::string Entry(const std::string& name, const std::string& token, const std::string& tenants,
                  const std::string& extra = "") {
  return "  - name: " + name + "\n    sha256: " + Sha256Hex(token) + "\n    tenants: " + tenants +
         "\n" + extra;
}

class TempFile {
 public:
  TempFile() {
    char p[] = "/tmp/kvcd-tokens-XXXXXX";
    const int fd = mkstemp(p);
    close(fd);
    path_ = p;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  void Write(const std::string& text) const {
    // Through a rename, as an operator's tooling would replace the file.
    const std::string tmp = path_ + ".new";
    std::ofstream(tmp) << text;
    std::rename(tmp.c_str(), path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(TokenSetTest, ParsesEntriesAndFindsTokensByHash) {
  const std::string text =
      "tokens:\n" + Entry("a", "secret-a", "[team-a, \"\"]") +
      Entry("ops", "secret-ops", "[\"*\"]", "    register_models: true\n    data_plane: true\n");
  auto set = TokenSet::Parse(text, "tokens.yaml");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->size(), 2u);
  auto a = set->Find("secret-a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->name, "a");
  EXPECT_TRUE(a->MayUseTenant("team-a"));
  EXPECT_TRUE(a->MayUseTenant(""));
  EXPECT_FALSE(a->MayUseTenant("team-b"));
  EXPECT_FALSE(a->register_models);
  EXPECT_FALSE(a->data_plane);
  EXPECT_FALSE(a->unrestricted);
  auto ops = set->Find("secret-ops");
  ASSERT_NE(ops, nullptr);
  EXPECT_TRUE(ops->MayUseTenant("anything"));
  EXPECT_TRUE(ops->register_models);
  EXPECT_TRUE(ops->data_plane);
  EXPECT_EQ(set->Find("secret-b"), nullptr);
  EXPECT_EQ(set->Find(Sha256Hex("secret-a")), nullptr);  // the hash is not the token
}

TEST(TokenSetTest, UpperCaseHashesMatch) {
  std::string hash = Sha256Hex("tok");
  for (char& c : hash) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  auto set = TokenSet::Parse("tokens:\n  - {name: x, sha256: " + hash + ", tenants: [t]}\n", "f");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_NE(set->Find("tok"), nullptr);
}

TEST(TokenSetTest, MalformedFilesNameTheFileTheEntryAndWhatWasExpected) {
  const std::string h = Sha256Hex("t");
  struct Case {
    std::string text;
    std::string expect;  // a substring of the message
  };
  const Case cases[] = {
      {"tokens: [", "not valid YAML"},
      {"- a\n- b\n", "expected a mapping with one key 'tokens'"},
      {"tokenz: []\n", "expected a mapping with one key 'tokens'"},
      {"tokens: []\nextra: 1\n", "unknown key 'extra'"},
      {"tokens: {a: 1}\n", "'tokens' must be a list"},
      {"tokens:\n  - 5\n", "tokens[0] must be a mapping"},
      {"tokens:\n  - {sha256: " + h + ", tenants: [a]}\n", "tokens[0].name is missing"},
      {"tokens:\n  - {name: x, sha256: abc, tenants: [a]}\n",
       "tokens[0].sha256 (token 'x') is 'abc', expected 64 hex digits"},
      {"tokens:\n  - {name: x, tenants: [a]}\n", "expected 64 hex digits"},
      {"tokens:\n  - {name: x, sha256: " + std::string(64, 'g') + ", tenants: [a]}\n",
       "expected 64 hex digits"},
      {"tokens:\n  - {name: x, sha256: " + h + "}\n",
       "tokens[0].tenants (token 'x') must be a list"},
      {"tokens:\n  - {name: x, sha256: " + h + ", tenants: a}\n", "must be a list"},
      {"tokens:\n  - {name: x, sha256: " + h + ", tenants: [[a]]}\n",
       "tokens[0].tenants[0] must be a string"},
      {"tokens:\n  - {name: x, sha256: " + h + ", tenants: [a], data_plane: yes}\n",
       "tokens[0].data_plane is 'yes', expected true or false"},
      {"tokens:\n  - {name: x, sha256: " + h + ", tenants: [a], admin: true}\n",
       "unknown key 'tokens[0].admin'"},
      {"tokens:\n  - {name: x, sha256: " + h +
           ", tenants: [a]}\n  - {name: x, sha256: " + Sha256Hex("u") + ", tenants: [a]}\n",
       "tokens[1].name 'x' appears twice"},
      {"tokens:\n  - {name: x, sha256: " + h + ", tenants: [a]}\n  - {name: y, sha256: " + h +
           ", tenants: [a]}\n",
       "tokens[1].sha256 is the same hash as an earlier entry"},
  };
  for (const Case& c : cases) {
    auto set = TokenSet::Parse(c.text, "/etc/kvcd/tokens.yaml");
    ASSERT_FALSE(set.ok()) << c.text;
    EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    const std::string msg(set.status().message());
    EXPECT_NE(msg.find("tokens file /etc/kvcd/tokens.yaml"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "got: " << msg << "\nfor:\n" << c.text;
  }
}

TEST(AuthenticateTest, MissingMalformedAndUnknownTokensAreUnauthenticated) {
  auto set = TokenSet::Parse("tokens:\n" + Entry("a", "good", "[t]"), "f");
  ASSERT_TRUE(set.ok());
  auto missing = Authenticate(*set, nullptr);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(missing.status().message().find("authorization: Bearer <token>"), std::string::npos);
  for (const std::string v : {"good", "Basic good", "Bearer ", "Bearer  good", "Bearer GOOD",
                              "Bearer bad", "Bearergood"}) {
    auto r = Authenticate(*set, &v);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnauthenticated) << v;
  }
  for (const std::string ok : {"Bearer good", "bearer good", "BEARER good"}) {
    auto p = Authenticate(*set, &ok);
    ASSERT_TRUE(p.ok()) << ok << ": " << p.status();
    EXPECT_EQ((*p)->name, "a");
  }
}

TEST(TokenStoreTest, UnreadableAndMalformedFilesNameTheFile) {
  auto missing = TokenStore::Load("/nonexistent/kvcd-tokens.yaml");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/kvcd-tokens.yaml"), std::string::npos);
  TempFile f;
  f.Write("tokens: 3\n");
  auto bad = TokenStore::Load(f.path());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(f.path()), std::string::npos);
}

TEST(TokenStoreTest, ReloadAddsAndRevokesAndKeepsThePreviousTokensOnABrokenFile) {
  TempFile f;
  f.Write("tokens:\n" + Entry("a", "tok-a", "[t]"));
  auto store = TokenStore::Load(f.path());
  ASSERT_TRUE(store.ok()) << store.status();
  TokenStore& s = **store;
  std::string msg;
  EXPECT_EQ(s.Reload(&msg), TokenStore::ReloadResult::kUnchanged);

  // Add b.
  f.Write("tokens:\n" + Entry("a", "tok-a", "[t]") + Entry("b", "tok-b", "[u]"));
  EXPECT_EQ(s.Reload(&msg), TokenStore::ReloadResult::kReloaded);
  EXPECT_NE(s.current()->Find("tok-b"), nullptr);

  // Revoke a.
  f.Write("tokens:\n" + Entry("b", "tok-b", "[u]"));
  EXPECT_EQ(s.Reload(&msg), TokenStore::ReloadResult::kReloaded);
  EXPECT_EQ(s.current()->Find("tok-a"), nullptr);
  EXPECT_NE(s.current()->Find("tok-b"), nullptr);

  // A broken file: reported once, the previous tokens stay.
  f.Write("tokens:\n  - {name: c, sha256: nothex, tenants: [t]}\n");
  msg.clear();
  EXPECT_EQ(s.Reload(&msg), TokenStore::ReloadResult::kFailed);
  EXPECT_NE(msg.find(f.path()), std::string::npos) << msg;
  EXPECT_NE(msg.find("keeping the previous 1 token(s)"), std::string::npos) << msg;
  EXPECT_NE(s.current()->Find("tok-b"), nullptr);
  EXPECT_EQ(s.Reload(&msg), TokenStore::ReloadResult::kUnchanged);

  // A deleted file: the same.
  std::remove(f.path().c_str());
  EXPECT_EQ(s.Reload(&msg), TokenStore::ReloadResult::kFailed);
  EXPECT_NE(s.current()->Find("tok-b"), nullptr);

  // Fixed again.
  f.Write("tokens:\n" + Entry("c", "tok-c", "[t]"));
  EXPECT_EQ(s.Reload(&msg), TokenStore::ReloadResult::kReloaded);
  EXPECT_NE(s.current()->Find("tok-c"), nullptr);
  EXPECT_EQ(s.current()->Find("tok-b"), nullptr);
}

}  // namespace auth_test
}  // namespace kvcd
