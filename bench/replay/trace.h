// A Mooncake-format request trace (JSONL, one request per line, in arrival order):
//   {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}
// with one hash id per 512-token block of the prompt (the last block may be partial). Two
// requests share a block id exactly when their prompts are equal up to the end of that block,
// so the ids encode the prefix chain: an id always follows the same id.
//
// Parsing checks every field and the chain property; a malformed line is INVALID_ARGUMENT
// naming the line, the field and what was expected.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcd::replay {

inline constexpr int64_t kTraceBlockTokens = 512;
// Bounds a request must respect (hostile or corrupt traces are refused, not replayed).
inline constexpr int64_t kMaxTraceTokens = int64_t{1} << 24;   // input or output, per request
inline constexpr int64_t kMaxHashId = (int64_t{1} << 53) - 1;  // exact in a JSON double
inline constexpr size_t kMaxTraceLineBytes = size_t{8} << 20;

struct TraceRequest {
  int64_t line = 0;  // 1-based line of the trace file
  int64_t timestamp_ms = 0;
  int64_t input_length = 0;
  int64_t output_length = 0;
  std::vector<int64_t> hash_ids;  // ceil(input_length / 512)
};

// One line (without its newline). `line_number` only goes into error messages.
absl::StatusOr<TraceRequest> ParseTraceLine(absl::string_view line, int64_t line_number);

// Every request of a stream (blank lines skipped), at most max_requests of them (<= 0: all),
// with the checks across lines: timestamps never go back, and a hash id always follows the
// same id (the prefix chain). `name` only goes into error messages.
absl::StatusOr<std::vector<TraceRequest>> ParseTrace(std::istream& in, absl::string_view name,
                                                     int64_t max_requests = 0);
// The same from a file (NOT_FOUND when it cannot be opened).
absl::StatusOr<std::vector<TraceRequest>> ReadTrace(const std::string& path,
                                                    int64_t max_requests = 0);

}  // namespace kvcd::replay
