#include "bench/replay/trace.h"

#include <fstream>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvcd::replay {

namespace {

using nlohmann::json;

absl::Status Bad(int64_t line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what));
}

// A JSON integer in [lo, hi]; floats, strings, booleans and out-of-range values are refused.
absl::StatusOr<int64_t> Integer(const json& v, int64_t line, absl::string_view field, int64_t lo,
                                int64_t hi) {
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Bad(line, absl::StrCat(field, " is ", u, ", expected ", lo, "..", hi));
    }
    x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    return Bad(line,
               absl::StrCat(field, " is ", v.dump(), ", expected an integer in ", lo, "..", hi));
  }
  if (x < lo || x > hi) {
    return Bad(line, absl::StrCat(field, " is ", x, ", expected ", lo, "..", hi));
  }
  return x;
}

}  // namespace

absl::StatusOr<TraceRequest> ParseTraceLine(absl::string_view text, int64_t line) {
  if (text.size() > kMaxTraceLineBytes) {
    return Bad(line, absl::StrCat("is ", text.size(), " bytes long, at most ", kMaxTraceLineBytes,
                                  " expected"));
  }
  const json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad(line, "not valid JSON (expected one JSON object per line)");
  if (!j.is_object())
    return Bad(line, absl::StrCat("a JSON ", j.type_name(), ", expected an object"));
  for (const char* field : {"timestamp", "input_length", "output_length", "hash_ids"}) {
    if (!j.contains(field)) return Bad(line, absl::StrCat("missing field \"", field, "\""));
  }
  TraceRequest r;
  r.line = line;
  auto ts = Integer(j["timestamp"], line, "timestamp", 0, std::numeric_limits<int64_t>::max());
  if (!ts.ok()) return ts.status();
  r.timestamp_ms = *ts;
  auto in = Integer(j["input_length"], line, "input_length", 1, kMaxTraceTokens);
  if (!in.ok()) return in.status();
  r.input_length = *in;
  auto out = Integer(j["output_length"], line, "output_length", 0, kMaxTraceTokens);
  if (!out.ok()) return out.status();
  r.output_length = *out;
  const json& ids = j["hash_ids"];
  if (!ids.is_array()) {
    return Bad(line, absl::StrCat("hash_ids is a JSON ", ids.type_name(), ", expected an array"));
  }
  const int64_t blocks = (r.input_length + kTraceBlockTokens - 1) / kTraceBlockTokens;
  if (static_cast<int64_t>(ids.size()) != blocks) {
    return Bad(line, absl::StrCat("hash_ids has ", ids.size(), " ids, expected ceil(input_length ",
                                  r.input_length, " / ", kTraceBlockTokens, ") = ", blocks));
  }
  r.hash_ids.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    auto id = Integer(ids[i], line, absl::StrCat("hash_ids[", i, "]"), 0, kMaxHashId);
    if (!id.ok()) return id.status();
    r.hash_ids.push_back(*id);
  }
  return r;
}

absl::StatusOr<std::vector<TraceRequest>> ParseTrace(std::istream& in, absl::string_view name,
                                                     int64_t max_requests) {
  std::vector<TraceRequest> out;
  // The prefix chain: the id each block id follows (-1: first block of a prompt).
  absl::flat_hash_map<int64_t, std::pair<int64_t, int64_t>> parent;  // id -> (parent, line)
  std::string text;
  int64_t line = 0;
  while ((max_requests <= 0 || static_cast<int64_t>(out.size()) < max_requests) &&
         std::getline(in, text)) {
    ++line;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto r = ParseTraceLine(text, line);
    if (!r.ok()) return absl::InvalidArgumentError(absl::StrCat(name, ": ", r.status().message()));
    if (!out.empty() && r->timestamp_ms < out.back().timestamp_ms) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": line ", line, ": timestamp ", r->timestamp_ms, " is before line ",
          out.back().line, "'s ", out.back().timestamp_ms, " (requests must be in arrival order)"));
    }
    for (size_t i = 0; i < r->hash_ids.size(); ++i) {
      const int64_t id = r->hash_ids[i];
      const int64_t before = i == 0 ? -1 : r->hash_ids[i - 1];
      auto [it, fresh] = parent.try_emplace(id, before, line);
      if (!fresh && it->second.first != before) {
        auto where = [](int64_t p) {
          return p < 0 ? std::string("first") : absl::StrCat("after id ", p);
        };
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": line ", line, ": hash_ids[", i, "] = ", id, " comes ", where(before),
            " but on line ", it->second.second, " it came ", where(it->second.first),
            " (a hash id names a whole prefix, so it always follows the same id)"));
      }
    }
    out.push_back(*std::move(r));
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat(name, ": read error after line ", line));
  return out;
}

absl::StatusOr<std::vector<TraceRequest>> ReadTrace(const std::string& path, int64_t max_requests) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open the trace ", path));
  return ParseTrace(in, path, max_requests);
}

}  // namespace kvcd::replay
