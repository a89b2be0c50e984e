#include "bench/replay/progress_bar.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_format.h"

namespace kvcd::replay {

ProgressBar::ProgressBar(int64_t total, bool enabled, std::FILE* out)
    : total_(std::max<int64_t>(total, 1)),
      enabled_(enabled),
      out_(out),
      tty_(isatty(fileno(out)) == 1),
      start_(std::chrono::steady_clock::now()) {}

void ProgressBar::Draw(int64_t done, const std::string& note) {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
  const double frac = std::min(1.0, static_cast<double>(done) / static_cast<double>(total_));
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth);
    const std::string bar = std::string(static_cast<size_t>(filled), '#') +
                            std::string(static_cast<size_t>(kWidth - filled), '.');
    std::fprintf(out_, "\r\033[K[%s] %3d%% %lld/%lld %.1f/s %s", bar.c_str(),
                 static_cast<int>(frac * 100), static_cast<long long>(done),
                 static_cast<long long>(total_), rate, note.c_str());
  } else {
    std::fprintf(out_, "%3d%% %lld/%lld %.1f/s %s\n", static_cast<int>(frac * 100),
                 static_cast<long long>(done), static_cast<long long>(total_), rate, note.c_str());
  }
  std::fflush(out_);
}

void ProgressBar::Update(int64_t done, const std::string& note) {
  done_ = done;
  note_ = note;
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    if (now - last_draw_ < std::chrono::milliseconds(100) && done < total_) return;
    last_draw_ = now;
    Draw(done, note);
    return;
  }
  const int64_t tenth = done * 10 / total_;
  if (tenth == last_tenth_) return;
  last_tenth_ = tenth;
  Draw(done, note);
}

void ProgressBar::Finish() {
  if (!enabled_ || finished_) return;
  finished_ = true;
  if (tty_) {
    Draw(done_, note_);
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

}  // namespace kvcd::replay
