#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvcd::log {
namespace {

std::atomic<Format> g_format{Format::kText};

absl::string_view BaseName(absl::string_view file) {
  const size_t slash = file.find_last_of('/');
  return slash == absl::string_view::npos ? file : file.substr(slash + 1);
}

}  // namespace

const char* LevelName(Level level) {
  switch (level) {
    case Level::INFO:
      return "INFO";
    case Level::WARNING:
      return "WARNING";
    case Level::ERROR:
      return "ERROR";
  }
  return "INFO";
}

void SetFormat(Format format) { g_format.store(format); }

absl::Status SetFormat(absl::string_view name) {
  if (name == "text") {
    SetFormat(Format::kText);
  } else if (name == "json") {
    SetFormat(Format::kJson);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("log format '", name, "' is not 'text' or 'json'"));
  }
  return absl::OkStatus();
}

std::string FormatLine(Format format, absl::Time time, Level level, absl::string_view file,
                       int line, absl::string_view message) {
  const std::string when = absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", time, absl::UTCTimeZone());
  const std::string source = absl::StrCat(BaseName(file), ":", line);
  if (format == Format::kText) {
    return absl::StrCat(when, " ", LevelName(level), " ", source, "] ", message);
  }
  nlohmann::ordered_json j;
  j["time"] = when;
  j["level"] = LevelName(level);
  j["source"] = source;
  j["message"] = std::string(message);
  // Bytes that are not UTF-8 (a peer's name, a path) become U+FFFD rather than an exception.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void Write(Level level, const char* file, int line, absl::string_view message) {
  std::string out = FormatLine(g_format.load(), absl::Now(), level, file, line, message);
  out += '\n';
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::fwrite(out.data(), 1, out.size(), stderr);
  std::fflush(stderr);
}

}  // namespace kvcd::log
