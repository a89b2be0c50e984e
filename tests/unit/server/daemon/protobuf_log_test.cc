// LogRateLimiter: at most N lines per window, then one line counting what was dropped.
#include "server/daemon/protobuf_log.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvcd {
namespace protobuf_log_test {

TEST(LogRateLimiterTest, PassesNLinesPerWindowAndCountsTheRest) {
  std::vector<std::string> out;
  LogRateLimiter limiter(3, std::chrono::milliseconds(1000),
                         [&](const std::string& l) { out.push_back(l); });
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; ++i) limiter.Log("line " + std::to_string(i), t0);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[2], "line 2");
  // The next window: the count of the dropped lines, then the new line.
  limiter.Log("later", t0 + std::chrono::milliseconds(1500));
  ASSERT_EQ(out.size(), 5u);
  EXPECT_NE(out[3].find("997 protobuf log line(s) suppressed"), std::string::npos) << out[3];
  EXPECT_EQ(out[4], "later");
  // A quiet window reports nothing dropped.
  limiter.Log("quiet", t0 + std::chrono::milliseconds(3000));
  ASSERT_EQ(out.size(), 6u);
  EXPECT_EQ(out[5], "quiet");
}

}  // namespace protobuf_log_test
}  // namespace kvcd
