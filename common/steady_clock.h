// SteadyNowNs: steady-clock nanoseconds, the clock of every lease deadline.
#pragma once

#include <chrono>
#include <cstdint>

namespace kvcd {

inline int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace kvcd
