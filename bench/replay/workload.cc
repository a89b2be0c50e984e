#include "bench/replay/workload.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "bench/replay/block_tokens.h"

namespace kvcd::replay {

absl::StatusOr<TraceWorkload> TraceWorkload::Create(std::vector<TraceRequest> trace,
                                                    int32_t page_size) {
  if (page_size < 1 || page_size > kTraceBlockTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size is ", page_size, ", expected 1..", kTraceBlockTokens));
  }
  if (static_cast<int64_t>(trace.size()) >= (int64_t{1} << 36)) {
    return absl::InvalidArgumentError("the trace has more than 2^36 requests");
  }
  TraceWorkload w;
  w.page_size_ = page_size;
  const int64_t n = static_cast<int64_t>(trace.size());
  // The requests holding each full block (in trace order): a request continuing request A
  // holds A's last full block, at the same position (the ids are a prefix chain).
  absl::flat_hash_map<int64_t, std::vector<int64_t>> holders;
  absl::flat_hash_set<int64_t> distinct;
  for (int64_t i = 0; i < n; ++i) {
    const TraceRequest& r = trace[static_cast<size_t>(i)];
    const int64_t full = r.input_length / kTraceBlockTokens;
    for (int64_t b = 0; b < full; ++b) {
      holders[r.hash_ids[static_cast<size_t>(b)]].push_back(i);
      distinct.insert(r.hash_ids[static_cast<size_t>(b)]);
    }
  }
  w.summary_.requests = n;
  w.summary_.distinct_blocks = static_cast<int64_t>(distinct.size());
  w.requests_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const TraceRequest& t = trace[static_cast<size_t>(i)];
    ReplayRequest& r = w.requests_[static_cast<size_t>(i)];
    r.index = i;
    r.timestamp_ms = t.timestamp_ms;
    r.input_length = t.input_length;
    r.output_length = t.output_length;
    const int64_t full = t.input_length / kTraceBlockTokens;
    r.prompt_pages.assign(t.hash_ids.begin(), t.hash_ids.begin() + full);
    // The first later request continuing this one.
    const TraceRequest* next = nullptr;
    if (full > 0) {
      const auto& h = holders[t.hash_ids[static_cast<size_t>(full - 1)]];
      for (auto it = std::upper_bound(h.begin(), h.end(), i); it != h.end(); ++it) {
        const TraceRequest& c = trace[static_cast<size_t>(*it)];
        if (c.input_length / kTraceBlockTokens > full &&
            c.input_length >= t.input_length + t.output_length) {
          next = &c;
          r.continued_by = *it;
          break;
        }
      }
    }
    const int64_t next_full = next ? next->input_length / kTraceBlockTokens : 0;
    auto continuation_key = [&](int64_t page) {
      return full + page < next_full ? next->hash_ids[static_cast<size_t>(full + page)]
                                     : UniqueKey(i, page);
    };
    const int64_t tail = ScaledTokens(t.input_length - full * kTraceBlockTokens, page_size);
    r.output_tokens = std::max<int64_t>(1, ScaledTokens(t.output_length, page_size));
    r.prompt.reserve(static_cast<size_t>(full * page_size + tail));
    for (int64_t key : r.prompt_pages) {
      for (int32_t k = 0; k < page_size; ++k) r.prompt.push_back(PageToken(key, k));
    }
    const int64_t after = tail + r.output_tokens;
    r.append.reserve(static_cast<size_t>(after));
    for (int64_t k = 0; k < after; ++k) {
      r.append.push_back(PageToken(continuation_key(k / page_size), k % page_size));
    }
    r.prompt.insert(r.prompt.end(), r.append.begin(), r.append.begin() + tail);
    for (int64_t p = 0; p < after / page_size; ++p) r.commit_pages.push_back(continuation_key(p));

    WorkloadSummary& s = w.summary_;
    s.prompt_tokens += t.input_length;
    s.output_tokens += t.output_length;
    s.full_blocks += full;
    s.continued += next ? 1 : 0;
    s.commit_pages += static_cast<int64_t>(r.commit_pages.size());
    for (int64_t key : r.commit_pages) s.commit_pages_continued += key >= 0 ? 1 : 0;
  }
  return w;
}

}  // namespace kvcd::replay
