// Bearer-token authentication (auth.tokens_file).
//
// The tokens file is YAML and stores only the SHA-256 of each token, never the token:
//
//   tokens:
//     - name: team-a-prefill      # shown in logs and errors (never the token itself)
//       sha256: 5e88...           # 64 hex digits: printf %s "$TOKEN" | sha256sum
//       tenants: [team-a]         # cache_salt values it may use; "" = the default
//                                 # tenant, "*" = every tenant
//       register_models: false    # may call RegisterModel
//       data_plane: false         # may register buffers, NCCL communicators and
//                                 # decode channels (and use them)
//
// A request carries the token in the metadata `authorization: Bearer <token>`. Missing
// or unknown tokens are UNAUTHENTICATED; what a known token may do is decided by
// Authorizer (authorizer.h). TokenStore reloads the file when its contents change and
// keeps the previous tokens if the new contents do not parse.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcd {

// Who a call runs as. With auth off every call runs as the unrestricted principal.
struct Principal {
  std::string name;           // the token's name; "" when auth is off
  bool unrestricted = false;  // auth off: any tenant, any operation, any object
  bool all_tenants = false;   // tenants: ["*"]
  std::set<std::string> tenants;
  bool register_models = false;
  bool data_plane = false;

  bool MayUseTenant(const std::string& salt) const {
    return unrestricted || all_tenants || tenants.count(salt) > 0;
  }
  // The principal of a daemon without auth.tokens_file.
  static std::shared_ptr<const Principal> Unrestricted();
};

// Lower-case hex SHA-256 of `data`.
std::string Sha256Hex(absl::string_view data);

// A parsed tokens file: SHA-256 (hex) -> principal.
class TokenSet {
 public:
  // Parses a tokens file's text. INVALID_ARGUMENT names `source` (the file), the entry
  // and the field, and says what was expected.
  static absl::StatusOr<TokenSet> Parse(const std::string& text, const std::string& source);

  // The principal of a bearer token, or nullptr if the token is unknown.
  std::shared_ptr<const Principal> Find(absl::string_view token) const;
  size_t size() const { return by_hash_.size(); }

 private:
  std::map<std::string, std::shared_ptr<const Principal>> by_hash_;
};

// Resolves the `authorization` metadata value of a call (nullptr: not sent) against a
// token set: UNAUTHENTICATED for a missing, malformed or unknown token.
absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(const TokenSet& tokens,
                                                              const std::string* authorization);

// The tokens file of a running daemon, reloaded when its contents change.
// Thread-safe.
class TokenStore {
 public:
  // Reads and parses the file: NOT_FOUND if it cannot be read, INVALID_ARGUMENT if it
  // is malformed (both name the file).
  static absl::StatusOr<std::unique_ptr<TokenStore>> Load(const std::string& path);

  std::shared_ptr<const TokenSet> current() const;
  const std::string& path() const { return path_; }

  enum class ReloadResult { kUnchanged, kReloaded, kFailed };
  // Re-reads the file; if its contents changed and parse, they replace the current
  // tokens. On kFailed the previous tokens stay in force and *message says why.
  ReloadResult Reload(std::string* message);

 private:
  explicit TokenStore(std::string path) : path_(std::move(path)) {}
  const std::string path_;
  mutable std::mutex mu_;
  std::shared_ptr<const TokenSet> tokens_ ABSL_GUARDED_BY(mu_);
  // Contents of the file the current tokens came from, and the last contents that
  // failed (reported once).
  std::string text_ ABSL_GUARDED_BY(mu_);
  std::string failed_text_ ABSL_GUARDED_BY(mu_);
};

// Reads a whole file; NOT_FOUND naming the file (and `what` it is) if it cannot be read.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const std::string& what);

}  // namespace kvcd
