// One connection to Redis (or Valkey) through hiredis, blocking with a timeout, for the
// index writer's thread. Commands go as argument vectors (binary-safe, no formatting) and
// a batch goes in one pipeline. Replies are copied out bounded: Redis is a shared store
// whose content any client may have written, so what comes back is not trusted.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

struct redisContext;

namespace kvcd {

struct RedisReply {
  enum class Type { kNil, kString, kInteger, kArray, kStatus, kError };
  Type type = Type::kNil;
  std::string str;  // kString, kStatus, kError
  int64_t integer = 0;
  std::vector<RedisReply> elements;  // kArray
  bool is_error() const { return type == Type::kError; }
};

class RedisConnection {
 public:
  // Bounds on a reply: longer strings or larger arrays fail the call (INVALID_ARGUMENT).
  static constexpr size_t kMaxString = 1 << 20;
  static constexpr size_t kMaxElements = 1 << 16;

  RedisConnection(std::string host, int port, std::chrono::milliseconds timeout);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Sends every command in one pipeline and reads all the replies, in order. UNAVAILABLE
  // when Redis cannot be reached or the connection breaks (the next call reconnects).
  // A command Redis refuses comes back as a reply of type kError, not as a failed call.
  absl::StatusOr<std::vector<RedisReply>> Pipeline(
      const std::vector<std::vector<std::string>>& commands);
  absl::StatusOr<RedisReply> Command(const std::vector<std::string>& command);
  void Disconnect();

 private:
  absl::Status Connect();

  const std::string host_;
  const int port_;
  const std::chrono::milliseconds timeout_;
  redisContext* ctx_ = nullptr;
};

}  // namespace kvcd
