// The daemon's log: one line per event on stderr, each with its time (UTC, microseconds),
// level and source line, as text or as one JSON object per line for log pipelines
// (--log-format=json):
//   2026-12-05T00:12:03.123456Z INFO daemon.cc:44] auth: off (no auth.tokens_file) ...
//   {"time":"2026-12-05T00:12:03.123456Z","level":"INFO","source":"daemon.cc:44","message":"auth:
//   off ..."}
//
//   KVCD_LOG(INFO) << "closed " << n << " sequence(s) whose lease expired";
//
// The interface is Abseil's LOG(severity) (absl/log): the Abseil this project builds against
// (Debian 12's 20220623) predates absl/log, so this file writes the lines itself; with
// Abseil 20230125 or later, KVCD_LOG becomes LOG and the JSON format a LogSink.
#pragma once

#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvcd::log {

enum class Level { INFO, WARNING, ERROR };
enum class Format { kText, kJson };

const char* LevelName(Level level);

// The format of every line written from now on (the default is kText).
void SetFormat(Format format);
// "text" or "json"; INVALID_ARGUMENT naming both otherwise.
absl::Status SetFormat(absl::string_view name);

// One line, formatted (without the newline); `file` is reduced to its base name.
std::string FormatLine(Format format, absl::Time time, Level level, absl::string_view file,
                       int line, absl::string_view message);

// Writes one line to stderr in the current format, in one write.
void Write(Level level, const char* file, int line, absl::string_view message);

// What KVCD_LOG builds: collects the message, writes it when destroyed.
class Message {
 public:
  Message(Level level, const char* file, int line) : level_(level), file_(file), line_(line) {}
  Message(const Message&) = delete;
  Message& operator=(const Message&) = delete;
  ~Message() { Write(level_, file_, line_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  Level level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

}  // namespace kvcd::log

#define KVCD_LOG(level) ::kvcd::log::Message(::kvcd::log::Level::level, __FILE__, __LINE__).stream()
