// Integration: what the real daemon tells an operator about itself — its log lines (time,
// level, source; one JSON object per line with --log-format=json) and its build and start
// time on /metrics (kvcd_build_info, kvcd_process_start_time_seconds).
#include <gtest/gtest.h>

#include <chrono>
#include <sstream>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "nlohmann/json.hpp"

namespace kvcd {
namespace observability_test {

using testing_util::DaemonProcess;
using testing_util::MetricValue;
using testing_util::ScrapeMetrics;

constexpr char kConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 1MiB
)";

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

TEST(ObservabilityTest, TextLogLinesHaveTimeLevelAndSource) {
  DaemonProcess d;
  ASSERT_TRUE(d.CaptureStderr());
  ASSERT_TRUE(d.Start(kConfig));
  EXPECT_EQ(d.Stop(), 0);
  const std::vector<std::string> lines = Lines(d.Stderr());
  ASSERT_FALSE(lines.empty());
  bool drained = false;
  for (const std::string& l : lines) {
    // 2026-12-05T00:12:03.123456Z INFO main.cc:170] drained, exiting
    ASSERT_GE(l.size(), 28u) << l;
    EXPECT_EQ(l[4], '-') << l;
    EXPECT_EQ(l[10], 'T') << l;
    EXPECT_EQ(l.substr(26, 2), "Z ") << l;
    const std::string rest = l.substr(28);
    EXPECT_TRUE(rest.rfind("INFO ", 0) == 0 || rest.rfind("WARNING ", 0) == 0 ||
                rest.rfind("ERROR ", 0) == 0)
        << l;
    EXPECT_NE(rest.find(".cc:"), std::string::npos) << l;
    drained |= rest.rfind("INFO main.cc:", 0) == 0 && l.size() > 16 &&
               l.compare(l.size() - 16, 16, "drained, exiting") == 0;
  }
  EXPECT_TRUE(drained) << d.Stderr();
}

TEST(ObservabilityTest, JsonLogIsOneObjectPerLine) {
  DaemonProcess d;
  ASSERT_TRUE(d.CaptureStderr());
  d.set_extra_args({"--log-format=json"});
  ASSERT_TRUE(d.Start(kConfig));
  EXPECT_EQ(d.Stop(), 0);
  const std::vector<std::string> lines = Lines(d.Stderr());
  ASSERT_GE(lines.size(), 3u) << d.Stderr();  // auth, tls, start-up, ..., drained
  std::vector<std::string> messages;
  for (const std::string& l : lines) {
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(l)) << l;
    ASSERT_TRUE(j.is_object()) << l;
    for (const char* key : {"time", "level", "source", "message"}) {
      ASSERT_TRUE(j.contains(key) && j[key].is_string()) << key << " in " << l;
    }
    EXPECT_EQ(j["time"].get<std::string>().size(), 27u) << l;
    messages.push_back(j["message"]);
  }
  EXPECT_EQ(messages.back(), "drained, exiting");
  EXPECT_EQ(messages.front().rfind("auth: off", 0), 0u) << messages.front();
}

TEST(ObservabilityTest, AnUnknownLogFormatIsAUsageError) {
  DaemonProcess d;
  ASSERT_TRUE(d.CaptureStderr());
  d.set_extra_args({"--log-format=xml"});
  EXPECT_FALSE(d.Start(kConfig));
  EXPECT_EQ(d.WaitExit(), 2);
  EXPECT_NE(d.Stderr().find("log format 'xml' is not 'text' or 'json'"), std::string::npos)
      << d.Stderr();
}

TEST(ObservabilityTest, MetricsCarryBuildInfoAndStartTime) {
  const double before = UnixNow();
  DaemonProcess d;
  ASSERT_TRUE(d.Start(kConfig));
  const std::string body = ScrapeMetrics(d);
  const double start = MetricValue(body, "kvcd_process_start_time_seconds");
  EXPECT_GE(start, before - 1) << body;
  EXPECT_LE(start, UnixNow() + 1) << body;
  // One sample, value 1: kvcd_build_info{backend="cpu",commit="...",cuda="...",version="..."} 1
  size_t samples = 0;
  for (const std::string& l : Lines(body)) {
    if (l.rfind("kvcd_build_info{", 0) != 0) continue;
    ++samples;
    EXPECT_NE(l.find("backend=\"cpu\""), std::string::npos) << l;
    EXPECT_NE(l.find("version=\"" KVCD_TEST_VERSION "\""), std::string::npos) << l;
    EXPECT_NE(l.find("commit=\""), std::string::npos) << l;
    EXPECT_EQ(l.find("commit=\"\""), std::string::npos) << l;
    EXPECT_NE(l.find("cuda=\""), std::string::npos) << l;
    EXPECT_EQ(l.substr(l.size() - 2), " 1") << l;
  }
  EXPECT_EQ(samples, 1u) << body;
  EXPECT_EQ(d.Stop(), 0);
}

}  // namespace observability_test
}  // namespace kvcd
