// RedisIndex: the block index as the cluster client reads it (docs/cluster.md "Block
// index"), through hiredis. Each lookup is one pipeline of HGETALLs. Everything read is
// untrusted: a field whose member is not live, whose incarnation differs from the
// member's, or whose value or load figures are malformed is ignored and counted
// (rejected()). A stale entry costs a miss, never a wrong answer: the daemon verifies.
// Thread-safe (one connection under a mutex; a broken connection is re-opened once per
// call).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/cluster/routing.h"

struct redisContext;

namespace kvcd::cluster {

inline constexpr size_t kMaxLookupPages = 1 << 16;
inline constexpr size_t kMaxHoldersPerPage = 1024;

// Member id -> its incarnation in membership (the fence).
using Incarnations = absl::flat_hash_map<std::string, std::string>;

class RedisIndex {
 public:
  // url: redis://host:port[/db]. INVALID_ARGUMENT for a malformed url or cluster name
  // ([A-Za-z0-9._-]{1,128}); UNAVAILABLE when Redis does not answer.
  static absl::StatusOr<std::unique_ptr<RedisIndex>> Connect(
      const std::string& url, const std::string& cluster_name,
      std::chrono::milliseconds timeout = std::chrono::milliseconds(2000));
  ~RedisIndex();

  // For each page hash (raw 32 bytes, at most kMaxLookupPages), the live members credited
  // with it.
  absl::StatusOr<std::vector<PageHolders>> Holders(absl::Span<const std::string> hashes,
                                                   const Incarnations& members);
  // Each member's load where its load: hash exists and names its incarnation.
  absl::StatusOr<absl::flat_hash_map<std::string, Load>> Loads(const Incarnations& members);

  int64_t rejected() const;
  const std::string& key_prefix() const { return prefix_; }

 private:
  RedisIndex(std::string host, int port, int db, std::string prefix,
             std::chrono::milliseconds timeout)
      : host_(std::move(host)),
        port_(port),
        db_(db),
        prefix_(std::move(prefix)),
        timeout_(timeout) {}
  absl::Status EnsureConnected();  // under mu_
  // Sends one HGETALL per key and reads the replies as field -> value maps.
  absl::StatusOr<std::vector<std::vector<std::pair<std::string, std::string>>>> HGetAll(
      const std::vector<std::string>& keys);

  std::string host_;
  int port_;
  int db_;
  std::string prefix_;  // kvcd:{<cluster>}:
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  redisContext* ctx_ = nullptr;
  int64_t rejected_ = 0;
};

}  // namespace kvcd::cluster
