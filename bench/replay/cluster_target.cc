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
  const size_t n = o.members.size();
  t->clients_.resize(n);
  t->targets_.resize(n);
  t->incarnation_of_.resize(n);
  t->down_.resize(n);
  t->listed_.assign(n, true);
  for (size_t i = 0; i < n; ++i) {
    t->ids_.push_back(o.members[i].member_id);
    if (absl::Status s = t->Attach(i, o.members[i].address, o.members[i].incarnation, false);
        !s.ok()) {
      return s;
    }
  }
  if (o.mode == RoutingMode::kIndex) {
    auto index = cluster::RedisIndex::Connect(o.redis_url, o.cluster_name);
    if (!index.ok()) return index.status();
    t->index_ = *std::move(index);
    t->hot_ =
        std::make_unique<cluster::HotPrefixes>(o.routing.window_s, o.routing.max_tracked_prefixes);
  }
  if (!o.etcd_endpoints.empty()) {
    auto d = cluster::MemberDirectory::Connect(o.etcd_endpoints, o.cluster_name);
    if (!d.ok()) return d.status();
    t->directory_ = *std::move(d);
  }
  t->figures_.member_ids = t->ids_;
  t->figures_.requests.assign(t->ids_.size(), 0);
  return t;
}

absl::Status ClusterTarget::Attach(size_t i, const std::string& address,
                                   const std::string& incarnation, bool prepare) {
  const std::string& id = ids_[i];
  ClientOptions co = options_.client;
  co.target = address;
  auto c = Client::Connect(co);
  if (!c.ok()) {
    return absl::Status(c.status().code(),
                        absl::StrCat("member ", id, " at ", address, ": ", c.status().message()));
  }
  auto d = DaemonTarget::Connect(co);
  if (!d.ok()) return d.status();
  (*d)->set_verify_every(options_.verify_every);
  if (prepare) {
    auto p = (*d)->Prepare(profile_);
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat("member ", id, ": ", p.status().message()));
    }
  }
  clients_[i] = *std::move(c);
  targets_[i] = *std::move(d);
  incarnation_of_[i] = incarnation;
  down_[i].clear();
  incarnations_[id] = incarnation;
  return absl::OkStatus();
}

void ClusterTarget::MarkDown(size_t i) {
  down_[i] = incarnation_of_[i];
  incarnations_.erase(ids_[i]);  // the index no longer credits it
}

void ClusterTarget::Sync() {
  if (directory_ == nullptr) return;
  const cluster::MemberDirectory::Members live = directory_->members();
  for (size_t i = 0; i < ids_.size(); ++i) {
    const auto it = live.find(ids_[i]);
    listed_[i] = it != live.end();
    if (!listed_[i]) {
      incarnations_.erase(ids_[i]);
      continue;
    }
    if (it->second.incarnation != incarnation_of_[i]) {
      // Back with another incarnation (a restart): its cache is new, its model unregistered.
      if (Attach(i, it->second.address, it->second.incarnation, true).ok()) ++figures_.rejoins;
      continue;
    }
    if (down_[i].empty()) incarnations_[ids_[i]] = incarnation_of_[i];
  }
}

std::vector<std::string> ClusterTarget::LiveIds() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < ids_.size(); ++i) {
    if (listed_[i] && down_[i].empty()) out.push_back(ids_[i]);
  }
  return out;
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

absl::StatusOr<size_t> ClusterTarget::Route(const ReplayRequest& r, std::string* pull_from,
                                            bool* index_error) {
  const std::vector<std::string> live = LiveIds();
  if (live.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", r.index, ": no member of the cluster is live"));
  }
  auto index_of = [&](const std::string& id) {
    return static_cast<size_t>(std::find(ids_.begin(), ids_.end(), id) - ids_.begin());
  };
  if (options_.mode == RoutingMode::kRandom) {
    return index_of(live[static_cast<size_t>(rng_() % live.size())]);
  }
  const auto t0 = std::chrono::steady_clock::now();
  BlockNamespace ns{profile_.name(), "", format_, static_cast<uint32_t>(profile_.page_size())};
  std::vector<BlockHash> raw = BlockHashes(ns, r.prompt);
  std::vector<std::string> hashes;
  hashes.reserve(raw.size());
  for (const BlockHash& h : raw) hashes.emplace_back(h.begin(), h.end());
  const std::string first = hashes.empty() ? std::string() : hashes[0];
  if (options_.mode == RoutingMode::kRendezvous) {
    return index_of(cluster::Rendezvous(first, live));
  }
  absl::StatusOr<std::vector<cluster::PageHolders>> holders =
      index_->Holders(hashes, incarnations_);
  absl::StatusOr<absl::flat_hash_map<std::string, cluster::Load>> loads =
      holders.ok()
          ? index_->Loads(incarnations_)
          : absl::StatusOr<absl::flat_hash_map<std::string, cluster::Load>>(holders.status());
  std::vector<cluster::PageHolders> none(hashes.size());
  if (!holders.ok() || !loads.ok()) {
    ++figures_.index_errors;
    *index_error = true;
  }
  const cluster::Decision d =
      cluster::Decide(hashes, holders.ok() && loads.ok() ? *holders : none, live,
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
  if (!started_) {
    started_ = true;
    t0_ = std::chrono::steady_clock::now();
  }
  Sync();
  RequestRecord rec;
  rec.index = r.index;
  rec.input_length = r.input_length;
  // Each member at most once: one that answers UNAVAILABLE is out and the request starts
  // over on another.
  for (size_t attempt = 0;; ++attempt) {
    std::string pull_from;
    absl::StatusOr<size_t> routed = Route(r, &pull_from, &rec.index_error);
    if (!routed.ok()) return routed.status();
    const size_t i = *routed;
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
    absl::StatusOr<RequestOutcome> out = targets_[i]->Serve(r, commit, log);
    if (!out.ok()) {
      if (!absl::IsUnavailable(out.status()) || attempt + 1 >= ids_.size()) return out.status();
      MarkDown(i);
      ++rec.unavailable;
      continue;
    }
    figures_.failovers += rec.unavailable > 0 ? 1 : 0;
    rec.member = static_cast<int>(i);
    rec.matched_tokens = out->matched_tokens;
    rec.checked = out->checked;
    rec.wrong = out->wrong;
    figures_.checked += out->checked ? 1 : 0;
    if (out->wrong) {
      ++figures_.wrong;
      if (figures_.wrong_details.size() < 10) figures_.wrong_details.push_back(out->wrong_detail);
    }
    rec.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    figures_.records.push_back(rec);
    return out;
  }
}

absl::StatusOr<TargetStats> ClusterTarget::Stats() {
  TargetStats sum;
  for (size_t i = 0; i < targets_.size(); ++i) {
    if (!down_[i].empty() || !listed_[i]) continue;  // a lost member's cache is gone
    auto s = targets_[i]->Stats();
    if (absl::IsUnavailable(s.status())) {
      MarkDown(i);
      continue;
    }
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
  for (size_t i = 0; i < targets_.size(); ++i) {
    int64_t held = 0;
    if (down_[i].empty() && listed_[i]) {
      auto s = targets_[i]->Stats();
      if (!s.ok() && !absl::IsUnavailable(s.status())) return s.status();
      if (s.ok()) held = s->cached_tokens / std::max(1, profile_.page_size());
    }
    figures_.pages_held.push_back(held);
  }
  if (index_ != nullptr) figures_.index_rejected = index_->rejected();
  return figures_;
}

}  // namespace kvcd::replay
