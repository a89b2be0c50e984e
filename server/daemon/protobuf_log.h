// Rate limit for protobuf's own log lines. Every request with an invalid UTF-8 string
// field makes protobuf log an ERROR line while parsing it (the call itself fails cleanly),
// so a hostile or broken client could fill the daemon's log (16k lines in five minutes
// of fuzzing). The string fields stay `string` (turning them into `bytes` would change
// the Python client's types from str to bytes and drop the UTF-8 check that keeps names
// printable); instead protobuf's log goes through a handler that passes at most
// `lines_per_window` lines per window and then one line saying how many it dropped.
//
// Thread safety: Install once at start-up, before serving; the handler is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace kvcd {

class LogRateLimiter {
 public:
  using Sink = std::function<void(const std::string& line)>;
  // `what` names the library in the line that counts the suppressed ones.
  LogRateLimiter(int lines_per_window, std::chrono::milliseconds window, Sink sink,
                 std::string what = "protobuf")
      : limit_(lines_per_window), window_(window), sink_(std::move(sink)), what_(std::move(what)) {}

  // Writes `line` to the sink unless this window's quota is spent; the first line of a
  // later window is preceded by "N <what> log line(s) suppressed ...".
  void Log(const std::string& line, std::chrono::steady_clock::time_point now);

 private:
  const int limit_;
  const std::chrono::milliseconds window_;
  const Sink sink_;
  const std::string what_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point window_start_{};
  int passed_ = 0;
  int64_t suppressed_ = 0;
};

// Routes protobuf's log through a LogRateLimiter into the daemon's log (10 lines per 10 s).
void InstallRateLimitedProtobufLog();

}  // namespace kvcd
