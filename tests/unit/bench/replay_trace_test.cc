#include <gtest/gtest.h>

#include <sstream>

#include "bench/replay/trace.h"

namespace kvcd::replay {
namespace replay_trace_test {

// The message holds `want`.
::testing::AssertionResult Says(absl::string_view message, absl::string_view want) {
  if (message.find(want) != absl::string_view::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << message << "\" does not say \"" << want << "\"";
}

absl::Status LineError(const std::string& line) { return ParseTraceLine(line, 7).status(); }

TEST(ReplayTrace, ParsesALine) {
  auto r = ParseTraceLine(
      R"({"timestamp": 27, "input_length": 1100, "output_length": 6, "hash_ids": [4, 5, 9]})", 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->line, 3);
  EXPECT_EQ(r->timestamp_ms, 27);
  EXPECT_EQ(r->input_length, 1100);
  EXPECT_EQ(r->output_length, 6);
  EXPECT_EQ(r->hash_ids, (std::vector<int64_t>{4, 5, 9}));
}

TEST(ReplayTrace, MalformedLinesNameTheLineAndTheField) {
  struct Case {
    std::string line, want;
  };
  const Case cases[] = {
      {"{\"timestamp\": 0,", "line 7: not valid JSON"},
      {"[1, 2]", "line 7: a JSON array, expected an object"},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": [1]})",
       "line 7: missing field \"timestamp\""},
      {R"({"timestamp": 0, "output_length": 1, "hash_ids": [1]})",
       "missing field \"input_length\""},
      {R"({"timestamp": 0, "input_length": 10, "hash_ids": [1]})",
       "missing field \"output_length\""},
      {R"({"timestamp": 0, "input_length": 10, "output_length": 1})", "missing field \"hash_ids\""},
      {R"({"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]})",
       "timestamp is -5, expected 0.."},
      {R"({"timestamp": 0, "input_length": -10, "output_length": 1, "hash_ids": [1]})",
       "input_length is -10, expected 1..16777216"},
      {R"({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []})",
       "input_length is 0, expected 1..16777216"},
      {R"({"timestamp": 0, "input_length": 99999999999999, "output_length": 1, "hash_ids": [1]})",
       "input_length is 99999999999999, expected 1..16777216"},
      {R"({"timestamp": 0, "input_length": 1e300, "output_length": 1, "hash_ids": [1]})",
       "input_length is 1e+300, expected an integer"},
      {R"({"timestamp": 0, "input_length": 10, "output_length": 18446744073709551615, "hash_ids": [1]})",
       "output_length is 18446744073709551615, expected 0..16777216"},
      {R"({"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]})",
       "output_length is -1"},
      {R"({"timestamp": 0, "input_length": 10, "output_length": "5", "hash_ids": [1]})",
       "output_length is \"5\", expected an integer"},
      {R"({"timestamp": 1.5, "input_length": 10, "output_length": 5, "hash_ids": [1]})",
       "timestamp is 1.5, expected an integer"},
      {R"({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": 1})",
       "hash_ids is a JSON number, expected an array"},
      {R"({"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]})",
       "hash_ids has 2 ids, expected ceil(input_length 1025 / 512) = 3"},
      {R"({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]})",
       "hash_ids[0] is -3"},
      {R"({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, null]})",
       "hash_ids[1] is null, expected an integer"},
  };
  for (const Case& c : cases) {
    const absl::Status s = LineError(c.line);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.line;
    EXPECT_TRUE(Says(std::string(s.message()), c.want)) << c.line;
  }
}

TEST(ReplayTrace, RefusesAnOverlongLine) {
  const std::string line(kMaxTraceLineBytes + 1, ' ');
  EXPECT_TRUE(Says(std::string(LineError(line).message()), "bytes long"));
}

TEST(ReplayTrace, ParsesAStreamSkippingBlankLinesAndStopsAtMaxRequests) {
  std::istringstream in(
      "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1]}\n"
      "\n"
      "{\"timestamp\": 3, \"input_length\": 1024, \"output_length\": 2, \"hash_ids\": [1, 2]}\n"
      "{\"timestamp\": 4, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [9]}\n");
  auto all = ParseTrace(in, "t.jsonl");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[1].line, 3);
  std::istringstream again(in.str());
  auto two = ParseTrace(again, "t.jsonl", 2);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->size(), 2u);
}

TEST(ReplayTrace, ErrorsAcrossLinesNameBothLines) {
  std::istringstream back(
      "{\"timestamp\": 5, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1]}\n"
      "{\"timestamp\": 4, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1]}\n");
  auto s = ParseTrace(back, "t.jsonl").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Says(std::string(s.message()), "t.jsonl: line 2: timestamp 4 is before line 1's 5"));
  // Block 2 first follows block 1, then starts a prompt: not a prefix chain.
  std::istringstream chain(
      "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 2]}\n"
      "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [2, 3]}\n");
  s = ParseTrace(chain, "t.jsonl").status();
  EXPECT_TRUE(Says(std::string(s.message()),
                   "line 2: hash_ids[0] = 2 comes first but on line 1 it came after id 1"));
  std::istringstream repeat(
      "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 1]}\n");
  s = ParseTrace(repeat, "t.jsonl").status();
  EXPECT_TRUE(Says(std::string(s.message()), "line 1: hash_ids[1] = 1 comes after id 1"));
  std::istringstream bad("{\"timestamp\": 0}\n");
  s = ParseTrace(bad, "t.jsonl").status();
  EXPECT_TRUE(Says(std::string(s.message()), "t.jsonl: line 1: missing field"));
}

TEST(ReplayTrace, MissingFileIsNotFound) {
  EXPECT_EQ(ReadTrace("/nonexistent/trace.jsonl").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace replay_trace_test
}  // namespace kvcd::replay
