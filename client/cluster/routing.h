// Routing (docs/cluster.md "Routing"): which member serves a prompt, as pure functions of
// what membership and the block index say. The Python client (kvcd.cluster.routing) does
// the same; both are tested on the same cases.
//
//   1. ConsecutivePrefixes: per member, the pages of the longest run from page 0 it holds.
//   2. LoadValue / Score: hit_tokens - alpha * load, load = pages_used/pages_capacity *
//      page_size * N + beta * (open_sequences + queued_decode).
//   3. Rendezvous over BoundedMembers: nobody holds page 0 (or the best score holds
//      nothing): the highest RendezvousWeight(member, first page hash) among the members
//      below bound x the mean load.
//   4. Hot prefix: routed to its holder more than replicate_after times in the window while
//      the holder is above the mean load: the rendezvous second pulls it and serves.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "client/cluster/hot_prefixes.h"

namespace kvcd::cluster {

// A member's load as it wrote it in the index (load:<member_id>).
struct Load {
  int64_t pages_used = 0;
  int64_t pages_capacity = 0;
  int64_t open_sequences = 0;
  int64_t queued_decode = 0;
  int64_t updated_ms = 0;
  bool operator==(const Load& o) const {
    return pages_used == o.pages_used && pages_capacity == o.pages_capacity &&
           open_sequences == o.open_sequences && queued_decode == o.queued_decode &&
           updated_ms == o.updated_ms;
  }
};

struct RoutingConfig {
  double alpha = 1.0;          // tokens of hit one unit of load is worth
  std::optional<double> beta;  // load per open sequence / queued decode; unset: page_size
  double bound = 1.25;         // bounded load: below bound x the mean
  int replicate_after = 8;     // routings of one prefix to one holder in the window; 0: off
  double window_s = 10.0;
  size_t max_tracked_prefixes = 4096;
};

// Member id -> tier ("device" / "host") for one page, already fenced by incarnation.
using PageHolders = absl::flat_hash_map<std::string, std::string>;

struct Decision {
  std::string member_id;
  int hit_pages = 0;      // pages the chosen member holds, as the index says
  std::string reason;     // "index", "rendezvous" or "replicate"
  std::string pull_from;  // with "replicate": the holder to pull from
};

absl::flat_hash_map<std::string, int> ConsecutivePrefixes(absl::Span<const PageHolders> holders);
// The load term of the score; a member without a load entry (nullptr) is idle and empty.
double LoadValue(const Load* load, int page_size, int n_members, std::optional<double> beta);
double Score(int hit_pages, int page_size, double load, double alpha);
// First 8 bytes, big-endian, of SHA-256(member_id 0x00 first_page_hash).
uint64_t RendezvousWeight(absl::string_view member_id, absl::string_view first_page_hash);
// The candidate with the highest weight (ties: the greater id). `candidates` non-empty.
std::string Rendezvous(absl::string_view first_page_hash, absl::Span<const std::string> candidates);
// Members (sorted) whose load is below bound x the mean; all when the mean is 0; the least
// loaded when none is.
std::vector<std::string> BoundedMembers(const absl::flat_hash_map<std::string, double>& loads,
                                        double bound);

// The decision for a prompt whose full pages hash to `hashes` (raw 32-byte strings, page 0
// first; `holders` the index's answer per page) over `members` minus `exclude`. `hot` may be
// null (no replication). Returns an empty member_id when no member is left.
Decision Decide(absl::Span<const std::string> hashes, absl::Span<const PageHolders> holders,
                absl::Span<const std::string> members,
                const absl::flat_hash_map<std::string, Load>& loads, int page_size,
                const RoutingConfig& config, HotPrefixes* hot,
                absl::Span<const std::string> exclude = {});

}  // namespace kvcd::cluster
