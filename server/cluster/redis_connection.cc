#include "server/cluster/redis_connection.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include "absl/strings/str_cat.h"

namespace kvcd {
namespace {

absl::Status Convert(const redisReply* r, int depth, RedisReply* out) {
  switch (r->type) {
    case REDIS_REPLY_NIL:
      out->type = RedisReply::Type::kNil;
      return absl::OkStatus();
    case REDIS_REPLY_INTEGER:
      out->type = RedisReply::Type::kInteger;
      out->integer = r->integer;
      return absl::OkStatus();
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
    case REDIS_REPLY_ERROR:
      out->type = r->type == REDIS_REPLY_STRING   ? RedisReply::Type::kString
                  : r->type == REDIS_REPLY_STATUS ? RedisReply::Type::kStatus
                                                  : RedisReply::Type::kError;
      if (r->len > RedisConnection::kMaxString) {
        return absl::InvalidArgumentError(absl::StrCat("redis: a reply string of ", r->len,
                                                       " bytes, more than the ",
                                                       RedisConnection::kMaxString, " accepted"));
      }
      out->str.assign(r->str, r->len);
      return absl::OkStatus();
    case REDIS_REPLY_ARRAY:
      out->type = RedisReply::Type::kArray;
      if (depth >= 3 || r->elements > RedisConnection::kMaxElements) {
        return absl::InvalidArgumentError(
            absl::StrCat("redis: a reply array of ", r->elements, " elements at depth ", depth,
                         ", more than accepted (", RedisConnection::kMaxElements, ", depth 3)"));
      }
      out->elements.resize(r->elements);
      for (size_t i = 0; i < r->elements; ++i) {
        if (absl::Status s = Convert(r->element[i], depth + 1, &out->elements[i]); !s.ok()) {
          return s;
        }
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat("redis: unknown reply type ", r->type));
  }
}

}  // namespace

RedisConnection::RedisConnection(std::string host, int port, std::chrono::milliseconds timeout)
    : host_(std::move(host)), port_(port), timeout_(timeout) {}

RedisConnection::~RedisConnection() { Disconnect(); }

void RedisConnection::Disconnect() {
  if (ctx_ != nullptr) redisFree(ctx_);
  ctx_ = nullptr;
}

absl::Status RedisConnection::Connect() {
  if (ctx_ != nullptr) return absl::OkStatus();
  timeval tv{};
  tv.tv_sec = timeout_.count() / 1000;
  tv.tv_usec = (timeout_.count() % 1000) * 1000;
  ctx_ = redisConnectWithTimeout(host_.c_str(), port_, tv);
  if (ctx_ == nullptr || ctx_->err != 0) {
    const std::string why = ctx_ == nullptr ? "out of memory" : ctx_->errstr;
    Disconnect();
    return absl::UnavailableError(
        absl::StrCat("redis ", host_, ":", port_, ": cannot connect: ", why));
  }
  if (redisSetTimeout(ctx_, tv) != REDIS_OK) {
    Disconnect();
    return absl::UnavailableError(
        absl::StrCat("redis ", host_, ":", port_, ": cannot set timeout"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RedisReply>> RedisConnection::Pipeline(
    const std::vector<std::vector<std::string>>& commands) {
  if (absl::Status s = Connect(); !s.ok()) return s;
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const auto& cmd : commands) {
    argv.clear();
    lens.clear();
    for (const std::string& a : cmd) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    if (redisAppendCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data()) !=
        REDIS_OK) {
      const std::string why = ctx_->errstr;
      Disconnect();
      return absl::UnavailableError(absl::StrCat("redis ", host_, ":", port_, ": ", why));
    }
  }
  std::vector<RedisReply> out(commands.size());
  absl::Status bad;
  for (size_t i = 0; i < commands.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) {
      const std::string why = ctx_->errstr;
      Disconnect();
      return absl::UnavailableError(absl::StrCat("redis ", host_, ":", port_, ": ", why));
    }
    redisReply* r = static_cast<redisReply*>(raw);
    if (bad.ok()) bad = Convert(r, 0, &out[i]);  // keep reading: the pipeline stays in step
    freeReplyObject(r);
  }
  if (!bad.ok()) return bad;
  return out;
}

absl::StatusOr<RedisReply> RedisConnection::Command(const std::vector<std::string>& command) {
  absl::StatusOr<std::vector<RedisReply>> r = Pipeline({command});
  if (!r.ok()) return r.status();
  return std::move(r->front());
}

}  // namespace kvcd
