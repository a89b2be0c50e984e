// A one-line progress bar on stderr, redrawn in place (at most 10 times a second) when
// stderr is a terminal; otherwise a plain line at every tenth of the way, so that logs stay
// short.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvcd::replay {

class ProgressBar {
 public:
  // `total`: units of work; `enabled` false: draws nothing.
  ProgressBar(int64_t total, bool enabled, std::FILE* out = stderr);
  ~ProgressBar() { Finish(); }
  // `done` units finished; `note` is shown after the counts ("hit 31.2%").
  void Update(int64_t done, const std::string& note = "");
  // Ends the line (once).
  void Finish();

 private:
  void Draw(int64_t done, const std::string& note);

  const int64_t total_;
  const bool enabled_;
  std::FILE* const out_;
  const bool tty_;
  const std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_{};
  int64_t last_tenth_ = -1, done_ = 0;
  std::string note_;
  bool finished_ = false;
};

}  // namespace kvcd::replay
