// Integration: prefix pins through the real daemon and the C++ client. A pinned system
// prompt survives a flood of one-off prompts that evicts everything else; once unpinned, or
// once its ttl runs out (the daemon's sweep; the test waits for Stats to show it gone), it
// is an ordinary LRU prefix that the next flood evicts. Stats and /metrics show the pin.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "client/client.h"
#include "daemon_process.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"
#include "tiny_daemon_fixture.h"

namespace kvcd {
namespace prefix_pins_integration_test {

using testing_util::DaemonProcess;
using testing_util::ScrapeMetrics;
using testing_util::WaitFor;

constexpr char kConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
memory_budget: 16MiB
lease: {default_ms: 40, max_ms: 60000}
max_pin_ttl_ms: 3600000
models:
  - builtin: tiny
    memory: 16384    # 16 pages of 4 tokens
)";

class PrefixPinsTest : public testing_util::TinyDaemonTest {
 protected:
  void SetUp() override { StartDaemon(kConfig); }

  void Put(uint64_t seed, int64_t n) {
    auto r = client_->Put(synthetic::Put(seed, profile_, n));
    ASSERT_TRUE(r.ok()) << seed << ": " << r.status();
  }
  int64_t Matched(uint64_t seed, int64_t n) {
    auto m = client_->Match("tiny", "", synthetic::Tokens(seed, 0, n));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? m->matched_tokens() : -1;
  }
  // 20 one-off prompts of 2 pages: 40 pages through a pool of 16.
  void Flood(uint64_t first_seed) {
    for (uint64_t seed = first_seed; seed < first_seed + 20; ++seed) Put(seed, 8);
  }
  int Pins() {
    auto s = client_->Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->pins_size() : -1;
  }
};

TEST_F(PrefixPinsTest, APinnedSystemPromptSurvivesAFloodUntilUnpinned) {
  const auto system = synthetic::Tokens(1, 0, 18);  // 4 full pages + 2 tokens
  Put(1, 18);
  auto pin = client_->PinPrefix("tiny", "", system, 600000);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->pinned_tokens(), 16);
  EXPECT_EQ(pin->pinned_pages(), 4);

  Flood(100);
  EXPECT_EQ(Matched(1, 18), 16);
  EXPECT_EQ(Matched(100, 8), 0);  // the one-off prompts evict each other
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GT(stats->evicted_pages(), 0u);
  ASSERT_EQ(stats->pins_size(), 1);
  EXPECT_EQ(stats->pins(0).pin_id(), pin->pin_id());
  EXPECT_EQ(stats->pins(0).model(), "tiny");
  EXPECT_EQ(stats->pins(0).pinned_pages(), 4);
  EXPECT_EQ(stats->pins(0).expires_unix_ms(), pin->expires_unix_ms());
  const std::string metrics = ScrapeMetrics(daemon_);
  EXPECT_NE(metrics.find("kvcd_prefix_pins{model=\"tiny\"} 1"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("kvcd_pinned_prefix_pages{model=\"tiny\"} 4"), std::string::npos);
  EXPECT_NE(metrics.find("kvcd_expired_pins_total 0"), std::string::npos);

  auto unpinned = client_->UnpinPrefix(pin->pin_id());
  ASSERT_TRUE(unpinned.ok()) << unpinned.status();
  EXPECT_EQ(*unpinned, 4);
  EXPECT_EQ(client_->UnpinPrefix(pin->pin_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Pins(), 0);
  Flood(200);
  EXPECT_EQ(Matched(1, 18), 0);  // an ordinary LRU prefix again
}

TEST_F(PrefixPinsTest, AnExpiredPinLetsThePrefixBeEvicted) {
  Put(1, 16);
  auto pin = client_->PinPrefix("tiny", "", synthetic::Tokens(1, 0, 16), 100);
  ASSERT_TRUE(pin.ok()) << pin.status();
  // The daemon's sweep removes it once its ttl ran out: wait for Stats to say so.
  ASSERT_TRUE(WaitFor([&] { return Pins() == 0; }, std::chrono::milliseconds(10000)));
  EXPECT_EQ(client_->UnpinPrefix(pin->pin_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(ScrapeMetrics(daemon_).find("kvcd_expired_pins_total 1"), std::string::npos);
  EXPECT_EQ(Matched(1, 16), 16);  // expiry evicts nothing by itself
  Flood(100);
  EXPECT_EQ(Matched(1, 16), 0);
}

TEST_F(PrefixPinsTest, BadPinsAreRefusedOverTheWire) {
  Put(1, 8);
  const auto prompt = synthetic::Tokens(1, 0, 8);
  struct Case {
    const char* name;
    absl::StatusCode code;
    absl::Status status;
    const char* says;
  };
  const Case cases[] = {
      {"ttl_ms 0", absl::StatusCode::kInvalidArgument,
       client_->PinPrefix("tiny", "", prompt, 0).status(),
       "ttl_ms is 0, expected 1..3600000 (the daemon's max_pin_ttl_ms)"},
      {"ttl_ms above max_pin_ttl_ms", absl::StatusCode::kInvalidArgument,
       client_->PinPrefix("tiny", "", prompt, 3600001).status(), "ttl_ms is 3600001"},
      {"negative ttl_ms", absl::StatusCode::kInvalidArgument,
       client_->PinPrefix("tiny", "", prompt, -1).status(), "ttl_ms is -1"},
      {"unknown model", absl::StatusCode::kNotFound,
       client_->PinPrefix("nope", "", prompt, 1000).status(), "model 'nope' is not registered"},
      {"nothing cached", absl::StatusCode::kNotFound,
       client_->PinPrefix("tiny", "", synthetic::Tokens(2, 0, 8), 1000).status(), "nothing to pin"},
      {"unknown pin", absl::StatusCode::kNotFound, client_->UnpinPrefix(42).status(),
       "pin 42 is not live"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.code(), c.code) << c.name << ": " << c.status;
    EXPECT_NE(c.status.message().find(c.says), absl::string_view::npos)
        << c.name << ": " << c.status;
  }
  EXPECT_EQ(Pins(), 0);
  EXPECT_EQ(Matched(1, 8), 8);
}

}  // namespace prefix_pins_integration_test
}  // namespace kvcd
