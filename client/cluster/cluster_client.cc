#include "client/cluster/cluster_client.h"

#include "absl/strings/str_cat.h"
#include "common/block_hash.h"

namespace kvcd::cluster {
namespace {

std::string HistoryFormatName(const v1::ModelInfo& info) {
  const v1::HistoryFormat hf = info.profile().history_format();
  if (hf == v1::HISTORY_FORMAT_UNSPECIFIED || hf == v1::HISTORY_FORMAT_BF16) return "bf16";
  for (const auto& pool : info.pools()) {
    if (pool.format() == "int2-transform" || pool.format() == "int2-oscar" ||
        pool.format() == "fsq") {
      return pool.format();
    }
  }
  return hf == v1::HISTORY_FORMAT_FSQ ? "fsq" : "int2-oscar";
}

}  // namespace

absl::StatusOr<std::unique_ptr<ClusterClient>> ClusterClient::Connect(
    ClusterClientOptions options) {
  std::unique_ptr<ClusterClient> c(new ClusterClient(std::move(options)));
  const ClusterClientOptions& o = c->options_;
  if (o.etcd_endpoints.empty() && o.dns_name.empty()) {
    return absl::InvalidArgumentError(
        "cluster membership: give the etcd endpoints (host:port) or a DNS name and port");
  }
  auto dir = !o.etcd_endpoints.empty()
                 ? MemberDirectory::Connect(o.etcd_endpoints, o.cluster_name)
                 : MemberDirectory::ConnectDns({o.dns_name, o.dns_port, o.client, o.dns_refresh});
  if (!dir.ok()) return dir.status();
  c->directory_ = *std::move(dir);
  if (!c->options_.redis_url.empty()) {
    auto index = RedisIndex::Connect(c->options_.redis_url, c->options_.cluster_name);
    if (!index.ok()) return index.status();
    c->index_ = *std::move(index);
  }
  c->hot_ = std::make_unique<HotPrefixes>(c->options_.routing.window_s,
                                          c->options_.routing.max_tracked_prefixes);
  return c;
}

absl::StatusOr<Client*> ClusterClient::ClientOf(const std::string& member_id) {
  const MemberDirectory::Members members = directory_->members();
  auto m = members.find(member_id);
  if (m == members.end()) {
    return absl::NotFoundError(absl::StrCat(member_id, " is not a live cluster member"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = clients_.find(member_id);
  if (it != clients_.end() && it->second.address == m->second.address &&
      it->second.incarnation == m->second.incarnation) {
    return it->second.client.get();
  }
  ClientOptions co = options_.client;
  co.target = m->second.address;
  // A member still in etcd but dead answers UNAVAILABLE soon, and routing moves on.
  co.connect_timeout = std::min(co.connect_timeout, std::chrono::milliseconds(2000));
  auto client = Client::Connect(co);
  if (!client.ok()) return client.status();
  if (it != clients_.end()) retired_.push_back(std::move(it->second.client));
  Cached& slot = clients_[member_id];
  slot = {m->second.address, m->second.incarnation, *std::move(client)};
  return slot.client.get();
}

void ClusterClient::MarkDown(const std::string& member_id) {
  const MemberDirectory::Members members = directory_->members();
  auto m = members.find(member_id);
  std::lock_guard<std::mutex> lock(mu_);
  down_[member_id] = {m == members.end() ? "" : m->second.incarnation,
                      std::chrono::steady_clock::now()};
}

MemberDirectory::Members ClusterClient::Live() {
  MemberDirectory::Members members = directory_->members();
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = down_.begin(); it != down_.end();) {
    auto m = members.find(it->first);
    if (now - it->second.second >= options_.down_for || m == members.end() ||
        m->second.incarnation != it->second.first) {
      down_.erase(it++);  // expired, gone, or restarted: no longer held against it
    } else {
      members.erase(m);
      ++it;
    }
  }
  return members;
}

absl::StatusOr<std::pair<std::string, int>> ClusterClient::Format(const std::string& model) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = formats_.find(model);
    if (it != formats_.end()) return it->second;
  }
  absl::Status last = absl::FailedPreconditionError("no live cluster member");
  for (const auto& [id, m] : Live()) {
    auto client = ClientOf(id);
    if (!client.ok()) continue;
    auto info = (*client)->GetModel(model);
    if (!info.ok()) {
      last = info.status();
      continue;
    }
    std::pair<std::string, int> f(HistoryFormatName(*info), info->profile().page_size());
    std::lock_guard<std::mutex> lock(mu_);
    formats_[model] = f;
    return f;
  }
  return absl::Status(last.code(), absl::StrCat("model ", model, ": ", last.message()));
}

absl::StatusOr<Decision> ClusterClient::Route(const std::string& model, const std::string& salt,
                                              absl::Span<const int32_t> tokens,
                                              absl::Span<const std::string> exclude) {
  auto format = Format(model);
  if (!format.ok()) return format.status();
  const auto t0 = std::chrono::steady_clock::now();
  BlockNamespace ns{model, salt, format->first, static_cast<uint32_t>(format->second)};
  std::vector<std::string> hashes;
  for (const BlockHash& h : BlockHashes(ns, tokens)) hashes.emplace_back(h.begin(), h.end());
  const MemberDirectory::Members live = Live();
  Incarnations inc;
  std::vector<std::string> ids;
  for (const auto& [id, m] : live) {
    inc[id] = m.incarnation;
    ids.push_back(id);
  }
  std::vector<PageHolders> holders(hashes.size());
  absl::flat_hash_map<std::string, Load> loads;
  if (index_ != nullptr) {
    // The index is a hint: when Redis does not answer, rendezvous decides.
    auto h = index_->Holders(hashes, inc);
    if (h.ok()) holders = *std::move(h);
    auto l = index_->Loads(inc);
    if (l.ok()) loads = *std::move(l);
  }
  last_lookup_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Decision d;
  {
    std::lock_guard<std::mutex> lock(mu_);
    d = Decide(hashes, holders, ids, loads, format->second, options_.routing, hot_.get(), exclude);
  }
  if (d.member_id.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no live member of cluster ", options_.cluster_name, " to route to (",
                     live.size(), " live, ", exclude.size(), " excluded)"));
  }
  return d;
}

std::string ClusterClient::Replicate(const Decision& d, const std::string& model,
                                     const std::string& salt, absl::Span<const int32_t> tokens) {
  auto client = ClientOf(d.member_id);
  if (!client.ok()) return d.pull_from;
  v1::PullPrefixRequest req;
  req.set_model(model);
  req.set_cache_salt(salt);
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  req.set_peer_member_id(d.pull_from);
  if (!(*client)->PullPrefix(req).ok()) return d.pull_from;  // serve on the holder instead
  ++replications_;
  return d.member_id;
}

absl::StatusOr<std::unique_ptr<ClusterSession>> ClusterClient::Open(
    const std::string& model, const std::string& salt, absl::Span<const int32_t> tokens,
    KvSource kv, int64_t lease_ms) {
  std::unique_ptr<ClusterSession> s(
      new ClusterSession(this, model, salt, std::vector<int32_t>(tokens.begin(), tokens.end()),
                         std::move(kv), lease_ms));
  std::vector<std::string> tried;
  while (true) {
    absl::Status st = s->OpenOn(tried);
    if (st.ok()) return s;
    if (!absl::IsUnavailable(st) || s->decision_.member_id.empty()) return st;
    tried.push_back(s->decision_.member_id);
    MarkDown(s->decision_.member_id);
    s->decision_ = Decision();
  }
}

absl::Status ClusterSession::OpenOn(absl::Span<const std::string> exclude) {
  auto d = cluster_->Route(model_, salt_, tokens_, exclude);
  if (!d.ok()) return d.status();
  decision_ = *d;
  std::string member = d->member_id;
  if (d->reason == "replicate") member = cluster_->Replicate(*d, model_, salt_, tokens_);
  auto client = cluster_->ClientOf(member);
  if (!client.ok()) return client.status();
  auto open = (*client)->OpenSequence(model_, salt_, tokens_, lease_ms_);
  if (!open.ok()) return open.status();
  const int64_t matched = open->matched_tokens();
  const int64_t n = static_cast<int64_t>(tokens_.size());
  if (matched < n) {
    v1::AppendRequest app;
    app.set_sequence_id(open->sequence_id());
    app.mutable_tokens()->Add(tokens_.begin() + matched, tokens_.end());
    absl::Status kv = kv_ ? kv_(matched, n - matched, app.mutable_k(), app.mutable_v())
                          : absl::FailedPreconditionError(
                                "the session has no KvSource to prefill what the member lacks");
    absl::StatusOr<int64_t> len = kv.ok() ? (*client)->Append(app) : absl::StatusOr<int64_t>(kv);
    if (!len.ok()) {
      (void)(*client)->CloseSequence(open->sequence_id());
      return len.status();
    }
  }
  member_id_ = member;
  sequence_id_ = open->sequence_id();
  matched_tokens_ = matched;
  return absl::OkStatus();
}

absl::Status ClusterSession::Failover() {
  const std::string lost = member_id_;
  cluster_->MarkDown(lost);
  ++failovers_;
  std::vector<std::string> exclude = {lost};
  while (true) {
    absl::Status s = OpenOn(exclude);
    if (s.ok()) break;
    if (!absl::IsUnavailable(s) || decision_.member_id.empty() ||
        decision_.member_id == exclude.back()) {
      return s;
    }
    cluster_->MarkDown(decision_.member_id);
    exclude.push_back(decision_.member_id);
  }
  reprefilled_tokens_ += static_cast<int64_t>(tokens_.size()) - matched_tokens_;
  return absl::OkStatus();
}

template <typename F>
auto ClusterSession::Run(F op) -> decltype(op()) {
  if (closed_) return absl::FailedPreconditionError("the cluster session is closed");
  auto r = op();
  if (r.ok() || !absl::IsUnavailable(r.status())) return r;
  absl::Status s = Failover();
  if (!s.ok()) return s;
  return op();
}

absl::StatusOr<int64_t> ClusterSession::Append(absl::Span<const int32_t> tokens,
                                               const v1::TensorRef& k, const v1::TensorRef& v) {
  auto r = Run([&]() -> absl::StatusOr<int64_t> {
    auto client = cluster_->ClientOf(member_id_);
    if (!client.ok()) return absl::UnavailableError(std::string(client.status().message()));
    v1::AppendRequest app;
    app.set_sequence_id(sequence_id_);
    app.mutable_tokens()->Add(tokens.begin(), tokens.end());
    *app.mutable_k() = k;
    *app.mutable_v() = v;
    return (*client)->Append(app);
  });
  if (r.ok()) tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  return r;
}

absl::StatusOr<v1::AttentionDecodeResponse> ClusterSession::AttentionDecode(
    v1::AttentionDecodeRequest req) {
  if (req.has_k_new() || req.has_v_new() || req.new_tokens_size() != 0) {
    return absl::InvalidArgumentError(
        "a cluster session appends new tokens with Append, not through AttentionDecode's "
        "k_new/v_new (so that it can re-send them after a failover)");
  }
  return Run([&]() -> absl::StatusOr<v1::AttentionDecodeResponse> {
    auto client = cluster_->ClientOf(member_id_);
    if (!client.ok()) return absl::UnavailableError(std::string(client.status().message()));
    req.clear_sequence_ids();
    req.add_sequence_ids(sequence_id_);
    return (*client)->AttentionDecode(req);
  });
}

absl::StatusOr<v1::CommitSequenceResponse> ClusterSession::Commit() {
  return Run([&]() -> absl::StatusOr<v1::CommitSequenceResponse> {
    auto client = cluster_->ClientOf(member_id_);
    if (!client.ok()) return absl::UnavailableError(std::string(client.status().message()));
    return (*client)->CommitSequence(sequence_id_);
  });
}

absl::StatusOr<std::unique_ptr<ClusterSession>> ClusterSession::Fork() {
  auto r = Run([&]() -> absl::StatusOr<v1::ForkSequenceResponse> {
    auto client = cluster_->ClientOf(member_id_);
    if (!client.ok()) return absl::UnavailableError(std::string(client.status().message()));
    return (*client)->ForkSequence(sequence_id_, lease_ms_);
  });
  if (!r.ok()) return r.status();
  std::unique_ptr<ClusterSession> twin(
      new ClusterSession(cluster_, model_, salt_, tokens_, kv_, lease_ms_));
  twin->member_id_ = member_id_;
  twin->sequence_id_ = r->sequence_id();
  twin->matched_tokens_ = static_cast<int64_t>(tokens_.size());
  twin->decision_ = decision_;
  return twin;
}

absl::StatusOr<int64_t> ClusterSession::Close(bool commit) {
  if (closed_) return length();
  absl::StatusOr<int64_t> r;
  if (commit) {
    r = Run([&]() -> absl::StatusOr<int64_t> {
      auto client = cluster_->ClientOf(member_id_);
      if (!client.ok()) return absl::UnavailableError(std::string(client.status().message()));
      auto c = (*client)->CloseSequence(sequence_id_, true);
      if (!c.ok()) return c.status();
      return c->length();
    });
  } else {
    auto client = cluster_->ClientOf(member_id_);
    r = client.ok() ? (*client)->CloseSequence(sequence_id_) : client.status();
    if (!r.ok() && absl::IsUnavailable(r.status())) cluster_->MarkDown(member_id_);
    if (!r.ok() && (absl::IsUnavailable(r.status()) || absl::IsNotFound(r.status()))) {
      r = length();  // the sequence is gone already (with its member, or its lease)
    }
  }
  closed_ = true;
  return r;
}

ClusterSession::~ClusterSession() {
  if (!closed_) (void)Close(false);
}

}  // namespace kvcd::cluster
