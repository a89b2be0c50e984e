#include "common/log.h"

#include <gtest/gtest.h>

#include "nlohmann/json.hpp"

namespace kvcd::log {
namespace log_test {

const absl::Time kTime = absl::FromUnixMicros(1764893523123456);  // 2025-12-05T00:12:03.123456Z

TEST(LogTest, TextLineHasTimeLevelSourceAndMessage) {
  EXPECT_EQ(FormatLine(Format::kText, kTime, Level::WARNING, "/src/server/daemon/daemon.cc", 64,
                       "--insecure: serving without TLS"),
            "2025-12-05T00:12:03.123456Z WARNING daemon.cc:64] --insecure: serving without TLS");
}

TEST(LogTest, JsonLineIsOneObjectWithTheSameFields) {
  const std::string line =
      FormatLine(Format::kJson, kTime, Level::ERROR, "main.cc", 7, "say \"no\"\nthen stop");
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j.at("time"), "2025-12-05T00:12:03.123456Z");
  EXPECT_EQ(j.at("level"), "ERROR");
  EXPECT_EQ(j.at("source"), "main.cc:7");
  EXPECT_EQ(j.at("message"), "say \"no\"\nthen stop");
  EXPECT_EQ(j.size(), 4u);
}

TEST(LogTest, JsonReplacesBytesThatAreNotUtf8) {
  const std::string line =
      FormatLine(Format::kJson, kTime, Level::INFO, "a.cc", 1, "bad \xff byte");
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j.at("message"), "bad \xEF\xBF\xBD byte");
}

TEST(LogTest, FormatByName) {
  EXPECT_TRUE(SetFormat("json").ok());
  EXPECT_TRUE(SetFormat("text").ok());
  const absl::Status s = SetFormat("xml");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "log format 'xml' is not 'text' or 'json'");
}

}  // namespace log_test
}  // namespace kvcd::log
