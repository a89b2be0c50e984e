#include "server/daemon/protobuf_log.h"

#include <google/protobuf/stubs/logging.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvcd {

void LogRateLimiter::Log(const std::string& line, std::chrono::steady_clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (now - window_start_ >= window_) {
    if (suppressed_ > 0) {
      sink_(absl::StrCat(suppressed_, " ", what_, " log line(s) suppressed in the last ",
                         window_.count(), " ms"));
    }
    window_start_ = now;
    passed_ = 0;
    suppressed_ = 0;
  }
  if (passed_ >= limit_) {
    ++suppressed_;
    return;
  }
  ++passed_;
  sink_(line);
}

namespace {

LogRateLimiter& ProtobufLimiter() {
  static LogRateLimiter* limiter =
      new LogRateLimiter(10, std::chrono::milliseconds(10000),
                         [](const std::string& line) { KVCD_LOG(WARNING) << line; });
  return *limiter;
}

void OnProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                   const std::string& message) {
  static const char* const kLevels[] = {"INFO", "WARNING", "ERROR", "FATAL"};
  const int l = static_cast<int>(level);
  ProtobufLimiter().Log(absl::StrCat("protobuf ", l >= 0 && l < 4 ? kLevels[l] : "LOG", " ",
                                     filename, ":", line, ": ", message),
                        std::chrono::steady_clock::now());
}

}  // namespace

void InstallRateLimitedProtobufLog() {
  ProtobufLimiter();
  google::protobuf::SetLogHandler(&OnProtobufLog);
}

}  // namespace kvcd
