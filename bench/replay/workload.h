// The replay workload: a trace's requests turned into what a client of a kvcd daemon sends
// for them, at a scale where one 512-token trace block is one page of `page_size` tokens.
//
// The model of a request (docs/performance.md "Replaying a trace"):
// - Its prompt is its full blocks, one page each (tokens: PageTokens(hash id)), then a partial
//   tail: the last, partial trace block scaled down (ScaledTokens of its real length). The
//   tail is not a full page, so it is never cached: it is prefilled every time.
// - Turn N+1's prompt is turn N's prompt plus the answer plus a new message. So the request's
//   sequence after its full blocks - the partial tail, then its output tokens - is the start
//   of its continuation: the blocks that the first later request continuing it has at those
//   positions (a look-ahead over the trace). A later request continues this one when its
//   prompt starts with this one's full blocks and is at least as long as this prompt plus its
//   output. Without one the continuation is unique to the request (UniqueKey pages).
// - Output: ScaledTokens(output_length) tokens, at least one. The full pages of the sequence
//   past the prompt's full blocks are what a commit adds to the cache; with a continuing
//   request they are the pages that request will look up.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/replay/trace.h"

namespace kvcd::replay {

struct ReplayRequest {
  int64_t index = 0;  // in the trace
  int64_t timestamp_ms = 0;
  int64_t input_length = 0, output_length = 0;  // trace (real) tokens
  // Keys of the prompt's full pages (its full blocks' hash ids), in order.
  std::vector<int64_t> prompt_pages;
  // The prompt: the full pages' tokens then the partial tail.
  std::vector<int32_t> prompt;
  // Appended after OpenSequence: the tail again (OpenSequence holds only full pages) and the
  // output tokens, as one Append.
  std::vector<int32_t> append;
  int64_t output_tokens = 0;  // scaled output tokens (the end of `append`)
  // Keys of the full pages of the sequence past prompt_pages (what a commit inserts), in order.
  std::vector<int64_t> commit_pages;
  int64_t continued_by = -1;  // index of the request continuing this one, or -1
};

struct WorkloadSummary {
  int64_t requests = 0;
  int64_t prompt_tokens = 0;  // trace (real) tokens
  int64_t output_tokens = 0;  // trace (real) tokens
  int64_t full_blocks = 0;    // prompt pages
  int64_t distinct_blocks = 0;
  int64_t continued = 0;               // requests with a continuing request
  int64_t commit_pages = 0;            // full pages past the prompts (all requests)
  int64_t commit_pages_continued = 0;  // of which keyed by a continuing request's blocks
};

class TraceWorkload {
 public:
  // page_size: tokens of the scaled page standing for one 512-token trace block (1..512).
  static absl::StatusOr<TraceWorkload> Create(std::vector<TraceRequest> trace, int32_t page_size);

  int32_t page_size() const { return page_size_; }
  int64_t size() const { return static_cast<int64_t>(requests_.size()); }
  const ReplayRequest& request(int64_t i) const { return requests_[static_cast<size_t>(i)]; }
  const WorkloadSummary& summary() const { return summary_; }

 private:
  int32_t page_size_ = 0;
  std::vector<ReplayRequest> requests_;
  WorkloadSummary summary_;
};

}  // namespace kvcd::replay
