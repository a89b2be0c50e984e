#include "bench/replay/cluster_target.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/block_hash.h"

namespace kvcd::replay {

absl::StatusOr<RoutingMode> ParseRoutingMode(const std::string& name) {
  if (name == "random") return RoutingMode::kRandom;
  if (name == "rendezvous") return RoutingMode::kRendezvous;
  if (name == "index") return RoutingMode::kIndex;
  return absl::InvalidArgumentError(
      absl::StrCat("routing mode \"", name, "\" is not random, rendezvous or index"));
}

const char* RoutingModeName(RoutingMode m) {
  switch (m) {
    case RoutingMode::kRandom:
      return "random";
    case RoutingMode::kRendezvous:
      return "rendezvous";
    case RoutingMode::kIndex:
      return "index";
  }
  return "?";
}

absl::StatusOr<std::vector<ClusterMember>> MembersFromStats(
    const std::vector<std::string>& addresses, const ClientOptions& client) {
  std::vector<ClusterMember> out;
  for (const std::string& a : addresses) {
    ClientOptions co = client;
    co.target = a;
    auto c = Client::Connect(co);
    if (!c.ok()) {
      return absl::Status(c.status().code(),
                          absl::StrCat("member at ", a, ": ", c.status().message()));
    }
    auto s = (*c)->Stats();
    if (!s.ok()) {
      return absl::Status(s.status().code(),
                          absl::StrCat("Stats of the member at ", a, ": ", s.status().message()));
    }
    out.push_back({s->member_id().empty() ? a : s->member_id(), a, s->incarnation()});
    for (size_t i = 0; i + 1 < out.size(); ++i) {
      if (out[i].member_id == out.back().member_id) {
        return absl::InvalidArgumentError(
            absl::StrCat("the members at ", out[i].address, " and ", a, " both call themselves ",
                         out.back().member_id, ": give each daemon its own cluster.member_id"));
      }
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<ClusterTarget>> ClusterTarget::Connect(
    ClusterTargetOptions options) {
  if (options.members.empty()) {
    return absl::InvalidArgumentError("a cluster target needs at least one member");
  }
  std::unique_ptr<ClusterTarget> t(new ClusterTarget(std::move(options)));
  const ClusterTargetOptions& o = t->options_;
  t->rng_.seed(o.seed);
  for (const ClusterMember& m : o.members) {
    ClientOptions co = o.client;
    co.target = m.address;
    auto c = Client::Connect(co);
    if (!c.ok()) {
      return absl::Status(c.status().code(), absl::StrCat("member ", m.member_id, " at ", m.address,
                                                          ": ", c.status().message()));
    }
    auto d = DaemonTarget::Connect(co);
    if (!d.ok()) return d.status();
    t->clients_.push_back(*std::move(c));
    t->targets_.push_back(*std::move(d));
    t->ids_.push_back(m.member_id);
    t->incarnations_[m.member_id] = m.incarnation;
  }
  if (o.mode == RoutingMode::kIndex) {
    auto index = cluster::RedisIndex::Connect(o.redis_url, o.cluster_name);
    if (!index.ok()) return index.status();
    t->index_ = *std::move(index);
    t->hot_ =
        std::make_unique<cluster::HotPrefixes>(o.routing.window_s, o.routing.max_tracked_prefixes);
  }
  t->figures_.member_ids = t->ids_;
  t->figures_.requests.assign(t->ids_.size(), 0);
  return t;
}

std::string ClusterTarget::Describe() const {
  return absl::StrCat(
      "cluster of ", ids_.size(), " daemons (", RoutingModeName(options_.mode), " routing",
      options_.mode == RoutingMode::kIndex && options_.pull ? ", peer pulls" : "", ")");
}

absl::StatusOr<int64_t> ClusterTarget::Prepare(const v1::ModelProfile& profile) {
  int64_t capacity = 0;
  for (size_t i = 0; i < targets_.size(); ++i) {
    auto c = targets_[i]->Prepare(profile);
    if (!c.ok()) {
      return absl::Status(c.status().code(),
                          absl::StrCat("member ", ids_[i], ": ", c.status().message()));
    }
    capacity += *c;
  }
  profile_ = profile;
  return capacity;
}

size_t ClusterTarget::Route(const ReplayRequest& r, std::string* pull_from) {
  const size_t n = ids_.size();
  if (options_.mode == RoutingMode::kRandom) {
    return static_cast<size_t>(rng_() % n);
  }
  const auto t0 = std::chrono::steady_clock::now();
  BlockNamespace ns{profile_.name(), "", format_, static_cast<uint32_t>(profile_.page_size())};
  std::vector<BlockHash> raw = BlockHashes(ns, r.prompt);
  std::vector<std::string> hashes;
  hashes.reserve(raw.size());
  for (const BlockHash& h : raw) hashes.emplace_back(h.begin(), h.end());
  const std::string first = hashes.empty() ? std::string() : hashes[0];
  auto index_of = [&](const std::string& id) {
    return static_cast<size_t>(std::find(ids_.begin(), ids_.end(), id) - ids_.begin());
  };
  if (options_.mode == RoutingMode::kRendezvous) {
    return index_of(cluster::Rendezvous(first, ids_));
  }
  absl::StatusOr<std::vector<cluster::PageHolders>> holders =
      index_->Holders(hashes, incarnations_);
  absl::StatusOr<absl::flat_hash_map<std::string, cluster::Load>> loads =
      holders.ok()
          ? index_->Loads(incarnations_)
          : absl::StatusOr<absl::flat_hash_map<std::string, cluster::Load>>(holders.status());
  std::vector<cluster::PageHolders> none(hashes.size());
  if (!holders.ok() || !loads.ok()) ++figures_.index_errors;
  const cluster::Decision d =
      cluster::Decide(hashes, holders.ok() && loads.ok() ? *holders : none, ids_,
                      loads.ok() ? *loads : absl::flat_hash_map<std::string, cluster::Load>{},
                      profile_.page_size(), options_.routing, hot_.get());
  figures_.lookup_seconds.push_back(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (d.reason == "replicate") {
    ++figures_.replications;
    *pull_from = d.pull_from;
  } else if (options_.pull && holders.ok()) {
    // A holder of a longer prefix lost to load: the chosen member pulls the difference.
    std::string best;
    int best_run = d.hit_pages;
    for (const auto& [m, run] : cluster::ConsecutivePrefixes(*holders)) {
      if (run > best_run || (run == best_run && run > d.hit_pages && m > best)) {
        best = m;
        best_run = run;
      }
    }
    if (!best.empty()) *pull_from = best;
  }
  if (!options_.pull) pull_from->clear();
  return index_of(d.member_id);
}

absl::StatusOr<RequestOutcome> ClusterTarget::Serve(const ReplayRequest& r, bool commit,
                                                    LatencyLog* log) {
  std::string pull_from;
  const size_t i = Route(r, &pull_from);
  ++figures_.requests[i];
  if (!pull_from.empty() && pull_from != ids_[i]) {
    v1::PullPrefixRequest pull;
    pull.set_model(profile_.name());
    pull.mutable_tokens()->Add(r.prompt.begin(), r.prompt.end());
    pull.set_peer_member_id(pull_from);
    const auto t0 = std::chrono::steady_clock::now();
    auto p = clients_[i]->PullPrefix(pull);
    figures_.pull_seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (p.ok()) {
      ++figures_.pulls;
      figures_.pulled_tokens += p->pulled_tokens();
      figures_.pulled_bytes += p->pulled_bytes();
    } else {
      ++figures_.pull_errors;  // the member prefills instead: a miss, never a wrong answer
    }
  }
  return targets_[i]->Serve(r, commit, log);
}

absl::StatusOr<TargetStats> ClusterTarget::Stats() {
  TargetStats sum;
  for (auto& t : targets_) {
    auto s = t->Stats();
    if (!s.ok()) return s.status();
    sum.evicted_pages += s->evicted_pages;
    sum.evicted_pages_committed += s->evicted_pages_committed;
    sum.committed_pages += s->committed_pages;
    sum.hit_tokens_committed += s->hit_tokens_committed;
    sum.cached_tokens += s->cached_tokens;
  }
  return sum;
}

absl::StatusOr<ClusterFigures> ClusterTarget::Figures() {
  figures_.pages_held.clear();
  for (auto& t : targets_) {
    auto s = t->Stats();
    if (!s.ok()) return s.status();
    figures_.pages_held.push_back(s->cached_tokens / std::max(1, profile_.page_size()));
  }
  if (index_ != nullptr) figures_.index_rejected = index_->rejected();
  return figures_;
}

}  // namespace kvcd::replay
