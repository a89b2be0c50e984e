#include "server/rpc/auth.h"

#include <openssl/evp.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcd {
namespace {

constexpr size_t kMaxTokensFileBytes = 4 << 20;

bool IsHex64(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

absl::Status Bad(const std::string& source, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("tokens file ", source, ": ", what));
}

absl::StatusOr<bool> ReadBool(const YAML::Node& entry, const char* key, const std::string& where,
                              const std::string& source) {
  const YAML::Node v = entry[key];
  if (!v) return false;
  if (!v.IsScalar()) return Bad(source, absl::StrCat(where, ".", key, " must be true or false"));
  const std::string s = absl::AsciiStrToLower(v.Scalar());
  if (s == "true") return true;
  if (s == "false") return false;
  return Bad(source,
             absl::StrCat(where, ".", key, " is '", v.Scalar(), "', expected true or false"));
}

}  // namespace

std::shared_ptr<const Principal> Principal::Unrestricted() {
  static const std::shared_ptr<const Principal> p = [] {
    auto q = std::make_shared<Principal>();
    q->unrestricted = true;
    q->all_tenants = true;
    q->register_models = true;
    q->data_plane = true;
    return q;
  }();
  return p;
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[md[i] >> 4]);
    out.push_back(kHex[md[i] & 15]);
  }
  return out;
}

absl::StatusOr<TokenSet> TokenSet::Parse(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return Bad(source, absl::StrCat("not valid YAML: ", e.what()));
  }
  if (!root.IsMap() || !root["tokens"]) {
    return Bad(source,
               "expected a mapping with one key 'tokens' (a list of entries with name, "
               "sha256, tenants, register_models, data_plane)");
  }
  TokenSet set;
  try {
    for (const auto& kv : root) {
      if (kv.first.as<std::string>() != "tokens") {
        return Bad(source, absl::StrCat("unknown key '", kv.first.as<std::string>(),
                                        "'; expected only 'tokens'"));
      }
    }
    const YAML::Node tokens = root["tokens"];
    if (!tokens.IsSequence()) return Bad(source, "'tokens' must be a list");
    std::set<std::string> names;
    for (size_t i = 0; i < tokens.size(); ++i) {
      const YAML::Node e = tokens[i];
      const std::string where = absl::StrCat("tokens[", i, "]");
      if (!e.IsMap()) return Bad(source, where + " must be a mapping");
      for (const auto& kv : e) {
        const std::string key = kv.first.as<std::string>();
        if (key != "name" && key != "sha256" && key != "tenants" && key != "register_models" &&
            key != "data_plane") {
          return Bad(source, absl::StrCat(
                                 "unknown key '", where, ".", key,
                                 "'; expected name, sha256, tenants, register_models, data_plane"));
        }
      }
      auto p = std::make_shared<Principal>();
      if (!e["name"] || !e["name"].IsScalar() || e["name"].Scalar().empty()) {
        return Bad(source, where + ".name is missing; every token needs a non-empty name");
      }
      p->name = e["name"].Scalar();
      if (!names.insert(p->name).second) {
        return Bad(source, absl::StrCat(where, ".name '", p->name, "' appears twice"));
      }
      const std::string hash =
          e["sha256"] && e["sha256"].IsScalar() ? e["sha256"].Scalar() : std::string();
      if (!IsHex64(hash)) {
        return Bad(source, absl::StrCat(where, ".sha256 (token '", p->name, "') is '", hash,
                                        "', expected 64 hex digits: the SHA-256 of the token, "
                                        "e.g. printf %s \"$TOKEN\" | sha256sum"));
      }
      const YAML::Node tenants = e["tenants"];
      if (!tenants || !tenants.IsSequence()) {
        return Bad(source, absl::StrCat(where, ".tenants (token '", p->name,
                                        "') must be a list of cache_salt values (\"*\" = all)"));
      }
      for (size_t t = 0; t < tenants.size(); ++t) {
        if (!tenants[t].IsScalar()) {
          return Bad(source, absl::StrCat(where, ".tenants[", t, "] must be a string"));
        }
        const std::string salt = tenants[t].Scalar();
        if (salt == "*") {
          p->all_tenants = true;
        } else {
          p->tenants.insert(salt);
        }
      }
      auto reg = ReadBool(e, "register_models", where, source);
      if (!reg.ok()) return reg.status();
      auto dp = ReadBool(e, "data_plane", where, source);
      if (!dp.ok()) return dp.status();
      p->register_models = *reg;
      p->data_plane = *dp;
      if (!set.by_hash_.emplace(absl::AsciiStrToLower(hash), std::move(p)).second) {
        return Bad(source, absl::StrCat(where, ".sha256 is the same hash as an earlier entry"));
      }
    }
  } catch (const YAML::Exception& e) {
    return Bad(source, e.what());
  }
  return set;
}

std::shared_ptr<const Principal> TokenSet::Find(absl::string_view token) const {
  auto it = by_hash_.find(Sha256Hex(token));
  return it == by_hash_.end() ? nullptr : it->second;
}

absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(const TokenSet& tokens,
                                                              const std::string* authorization) {
  if (authorization == nullptr) {
    return absl::UnauthenticatedError(
        "no credentials: this daemon requires the metadata 'authorization: Bearer <token>' "
        "with a token listed in its auth.tokens_file");
  }
  constexpr absl::string_view kBearer = "Bearer ";
  // The scheme is case-insensitive (RFC 7235); the token is not.
  if (!absl::StartsWithIgnoreCase(*authorization, kBearer) ||
      authorization->size() == kBearer.size()) {
    return absl::UnauthenticatedError("the 'authorization' metadata must be 'Bearer <token>'");
  }
  auto p = tokens.Find(absl::string_view(*authorization).substr(kBearer.size()));
  if (p == nullptr) {
    return absl::UnauthenticatedError(
        "the bearer token is not valid for this daemon (unknown or revoked)");
  }
  return p;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read ", what, " '", path, "': ", std::strerror(errno)));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  if (s.size() > kMaxTokensFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " '", path, "' has ", s.size(), " bytes, expected at most ", kMaxTokensFileBytes));
  }
  return s;
}

absl::StatusOr<std::unique_ptr<TokenStore>> TokenStore::Load(const std::string& path) {
  auto text = ReadSmallFile(path, "auth.tokens_file");
  if (!text.ok()) return text.status();
  auto set = TokenSet::Parse(*text, path);
  if (!set.ok()) return set.status();
  std::unique_ptr<TokenStore> store(new TokenStore(path));
  std::lock_guard<std::mutex> lock(store->mu_);
  store->tokens_ = std::make_shared<const TokenSet>(std::move(*set));
  store->text_ = std::move(*text);
  return store;
}

std::shared_ptr<const TokenSet> TokenStore::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tokens_;
}

TokenStore::ReloadResult TokenStore::Reload(std::string* message) {
  auto text = ReadSmallFile(path_, "auth.tokens_file");
  std::lock_guard<std::mutex> lock(mu_);
  if (!text.ok()) {
    if (failed_text_ == "\x01unreadable") return ReloadResult::kUnchanged;  // reported already
    failed_text_ = "\x01unreadable";
    *message = absl::StrCat(text.status().message(), "; keeping the previous ", tokens_->size(),
                            " token(s)");
    return ReloadResult::kFailed;
  }
  if (*text == text_) {
    failed_text_.clear();
    return ReloadResult::kUnchanged;
  }
  if (*text == failed_text_) return ReloadResult::kUnchanged;  // reported already
  auto set = TokenSet::Parse(*text, path_);
  if (!set.ok()) {
    failed_text_ = *text;
    *message = absl::StrCat(set.status().message(), "; keeping the previous ", tokens_->size(),
                            " token(s)");
    return ReloadResult::kFailed;
  }
  tokens_ = std::make_shared<const TokenSet>(std::move(*set));
  text_ = std::move(*text);
  failed_text_.clear();
  *message = absl::StrCat("reloaded ", path_, ": ", tokens_->size(), " token(s)");
  return ReloadResult::kReloaded;
}

}  // namespace kvcd
