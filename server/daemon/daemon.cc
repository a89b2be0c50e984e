#include "server/daemon/daemon.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvcd_commit.h"
#include "server/backends/backend.h"
#include "server/backends/fault_injector.h"
#include "server/cluster/block_index.h"
#include "server/cluster/cluster_metrics.h"
#include "server/cluster/dns_membership.h"
#include "server/cluster/etcd_membership.h"
#include "server/cluster/event_publisher.h"
#include "server/cluster/peer_credentials.h"
#include "server/cluster/prefix_puller.h"

namespace kvcd {
namespace {

std::string HostOf(const std::string& address) {
  const auto colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

void ApplyLimits(const ServerConfig& c, grpc::ServerBuilder* b) {
  b->SetMaxReceiveMessageSize(static_cast<int>(c.max_message_bytes));
  b->SetMaxSendMessageSize(static_cast<int>(c.max_message_bytes));
  b->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 1024);
  // Keepalive policy: accept client pings every >= 10 s, ping idle clients every 60 s.
  b->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  b->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  b->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  b->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // gRPC sets SO_REUSEPORT by default, which lets a second daemon bind the same port and
  // take half the new connections to a different cache. One port, one daemon.
  b->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  grpc::ResourceQuota quota("kvcd");
  quota.SetMaxThreads(256);
  b->SetResourceQuota(quota);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const ServerConfig& config) {
  KVCD_RETURN_IF_ERROR(CheckExposure(config));
  KVCD_RETURN_IF_ERROR(CheckMetricsExposure(config));
  std::unique_ptr<Daemon> d(new Daemon(config));
  if (config.auth.enabled()) {
    KVCD_ASSIGN_OR_RETURN(d->tokens_, TokenStore::Load(config.auth.tokens_file));
    KVCD_LOG(INFO) << "auth: " << d->tokens_->current()->size() << " token(s) from "
                   << config.auth.tokens_file << " (reloaded on change)";
  } else {
    KVCD_LOG(INFO) << "auth: off (no auth.tokens_file): every caller may use every tenant";
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (config.tls.enabled()) {
    KVCD_ASSIGN_OR_RETURN(d->tls_, TlsCredentialSource::Create(config.tls));
    creds = d->tls_->ServerCredentials();
    KVCD_LOG(INFO) << "tls: on ("
                   << (config.tls.client_ca_file.empty() ? "server certificate only"
                                                         : "mutual: client certificates required")
                   << "), certificate " << config.tls.cert_file << ", reloaded on change";
  } else {
    KVCD_LOG(INFO) << "tls: off (no tls.cert_file): the API port is plaintext";
  }
  if (config.insecure && !IsLoopbackAddress(config.listen) &&
      !(config.tls.enabled() && config.auth.enabled())) {
    KVCD_LOG(WARNING) << "--insecure: serving "
                      << (config.tls.enabled()    ? "without authentication"
                          : config.auth.enabled() ? "without TLS (tokens travel in clear text)"
                                                  : "without TLS or authentication")
                      << " on non-loopback address '" << config.listen
                      << "'; anyone who can reach it can read and overwrite every tenant's KV "
                         "cache";
  }
  std::unique_ptr<Backend> backend;
  if (config.backend == "cpu") {
    backend = MakeCpuBackend(config.compute_threads);
  } else {
#ifdef KVCD_HAVE_CUDA_BACKEND
    KVCD_ASSIGN_OR_RETURN(backend, MakeCudaBackend(config.cuda_device));
#else
    return absl::InvalidArgumentError(
        "backend 'cuda' is not available in this build of the daemon (built without CUDA); "
        "use backend: cpu");
#endif
  }
  if (!config.fault_inject.empty()) {
    KVCD_ASSIGN_OR_RETURN(std::shared_ptr<FaultInjector> injector,
                          FaultInjector::Parse(config.fault_inject));
    KVCD_LOG(WARNING) << "--fault-inject " << config.fault_inject
                      << ": the backend fails on purpose (tests)";
    backend = WithFaultInjection(std::move(backend), std::move(injector));
  }
  d->engine_ = std::make_unique<CacheEngine>(config, std::move(backend));
  if (config.cluster.present) {
    d->incarnation_ = NewIncarnation();
    d->engine_->SetClusterIdentity(config.cluster.member_id, d->incarnation_);
  }
  if (config.cluster.has_peers() && !config.cluster.redis_url.empty()) {
    // The index hears of every page from the first model on (it writes once advertised).
    CacheEngine* engine = d->engine_.get();
    Daemon* raw = d.get();
    BlockIndex::Options o;
    o.cluster = config.cluster;
    o.member_id = config.cluster.member_id;
    o.incarnation = d->incarnation_;
    o.tier = config.backend == "cuda" ? "device" : "host";
    o.load = [engine] {
      const CacheEngine::LoadFigures f = engine->Load();
      return BlockIndex::Load{f.pages_used, f.pages_capacity, f.open_sequences, f.queued_decode};
    };
    o.replay = [engine, raw] { engine->ReplayBlocks(raw->index_.get()); };
    o.is_member = [raw](const MemberInfo& m) {
      if (!raw->membership_) return false;
      const std::optional<MemberInfo> now = raw->membership_->Find(m.member_id);
      return now.has_value() && now->incarnation == m.incarnation;
    };
    d->index_ = std::make_unique<BlockIndex>(std::move(o));
    d->observers_.Add(d->index_.get());
  }
  if (config.cluster.present && !config.cluster.events_endpoint.empty()) {
    EventPublisher::Options o;
    o.endpoint = config.cluster.events_endpoint;
    o.replay_endpoint = config.cluster.events_replay_endpoint;
    o.buffer = config.cluster.events_buffer;
    o.medium = config.backend == "cuda" ? "GPU" : "CPU";
    KVCD_ASSIGN_OR_RETURN(d->events_, EventPublisher::Create(std::move(o)));
    d->observers_.Add(d->events_.get());
    KVCD_LOG(INFO) << "cluster: KV events on " << config.cluster.events_endpoint
                   << (config.cluster.events_replay_endpoint.empty()
                           ? std::string()
                           : ", replay on " + config.cluster.events_replay_endpoint);
  }
  if (!d->observers_.empty()) d->engine_->SetBlockObserver(&d->observers_);
  for (const ModelSpec& spec : config.models) {
    KVCD_RETURN_IF_ERROR(d->engine_->RegisterModelSpec(spec));
  }
  BuildLabels build{.version = KVCD_VERSION, .commit = KVCD_COMMIT, .backend = config.backend};
#ifdef KVCD_HAVE_CUDA_BACKEND
  build.cuda = true;
#endif
  d->metrics_ = std::make_unique<Metrics>(d->engine_.get(), build);
  if (config.cluster.present) {
    ClusterCollector::Parts parts;
    parts.index = d->index_.get();
    parts.events = d->events_.get();
    parts.membership = &d->membership_seen_;
    parts.puller = &d->puller_seen_;
    parts.ready = &d->puller_ready_;
    d->metrics_->AddCollectable(std::make_shared<ClusterCollector>(parts));
  }
  d->executor_ = std::make_unique<ThreadPool>(config.worker_threads);
  d->service_ = std::make_unique<KvCacheService>(d->engine_.get(), d->metrics_.get(),
                                                 d->executor_.get(), d->tokens_.get());
  if (config.cluster.has_peers()) {
    // The puller exists once membership runs (after the port is bound); until then a pull
    // is UNAVAILABLE.
    Daemon* raw = d.get();
    d->service_->set_pull_handler([raw](const v1::PullPrefixRequest& req,
                                        const std::string& authorization,
                                        v1::PullPrefixResponse* resp) -> absl::Status {
      PrefixPuller* puller = raw->puller_ready_.load() ? raw->puller_.get() : nullptr;
      if (puller == nullptr) {
        return absl::UnavailableError("PullPrefix: this daemon is still joining its cluster");
      }
      return puller->Pull(req, authorization, resp);
    });
  }

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.listen, creds, &port);
  builder.RegisterService(d->service_.get());
  builder.RegisterService(&d->health_);
  ApplyLimits(config, &builder);
  d->server_ = builder.BuildAndStart();
  if (d->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on '", config.listen,
        "': the address is invalid or already in use (is another kvcd serving this port?)"));
  }
  d->grpc_address_ = absl::StrCat(HostOf(config.listen), ":", port);
  d->health_.SetServing(true);

  if (!config.health_listen.empty()) {
    grpc::ServerBuilder hb;
    int hport = 0;
    hb.AddListeningPort(config.health_listen, grpc::InsecureServerCredentials(), &hport);
    hb.RegisterService(&d->health_only_);
    hb.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    d->health_server_ = hb.BuildAndStart();
    if (d->health_server_ == nullptr || hport == 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen for health on '", config.health_listen,
                       "': the address is invalid or already in use (is another kvcd serving "
                       "this port?)"));
    }
    d->health_address_ = absl::StrCat(HostOf(config.health_listen), ":", hport);
    d->health_only_.SetServing(true);
  }

  if (!config.metrics_listen.empty()) {
    if (!IsLoopbackAddress(config.metrics_listen)) {
      // CheckMetricsExposure refused metrics_per_tenant here: this is true.
      KVCD_LOG(WARNING) << "metrics on non-loopback address '" << config.metrics_listen
                        << "' are plaintext and unauthenticated (aggregate counters only, no "
                           "tenant data)";
    } else if (config.metrics_per_tenant) {
      KVCD_LOG(WARNING) << "metrics_per_tenant: the metrics on '" << config.metrics_listen
                        << "' name every tenant and its use (kvcd_tenant_*)";
    }
    KVCD_ASSIGN_OR_RETURN(int mport, d->metrics_->Serve(config.metrics_listen));
    d->metrics_address_ = absl::StrCat(HostOf(config.metrics_listen), ":", mport);
  }
  KVCD_RETURN_IF_ERROR(d->StartCluster());
  d->reaper_ = std::thread([raw = d.get()] { raw->ReaperLoop(); });
  return d;
}

absl::Status Daemon::StartCluster() {
  const ClusterConfig& k = config_.cluster;
  if (!k.present || k.membership == "none") return absl::OkStatus();
  MemberInfo self;
  self.member_id = k.member_id;
  self.address = k.advertise_address.empty() ? grpc_address_ : k.advertise_address;
  const std::string host = HostOf(self.address);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::") {
    return absl::FailedPreconditionError(
        absl::StrCat("cluster: the gRPC address '", self.address,
                     "' names no host peers can dial; set cluster.advertise_address to host:port"));
  }
  self.backend = config_.backend;
  const CacheEngine::LoadFigures load = engine_->Load();
  self.capacity_pages = load.pages_capacity;
  self.page_bytes = load.max_page_bytes;
  self.incarnation = incarnation_;
  self.started_unix_ms = absl::ToUnixMillis(absl::Now());
  self.version = KVCD_VERSION;
  self.events_endpoint = k.events_endpoint;
  self.node_id = LocalNodeId();
  if (k.membership == "dns") {
    KVCD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                          PeerCredentials(config_));
    const std::string& a = self.address;
    const int port = std::atoi(a.substr(a.rfind(':') + 1).c_str());
    membership_ = std::make_unique<DnsMembership>(k, std::move(self), port, std::move(creds));
  } else {
    membership_ = std::make_unique<EtcdMembership>(k, std::move(self));
  }
  // The health service "kvcd.cluster" says whether this member is advertised in its cluster
  // (NOT_SERVING while joining and after the lease is lost); "" and "kvcd.v1.KvCache" stay
  // as they are: the daemon serves its own sessions throughout.
  health_.SetServiceServing(kClusterHealthService, false);
  health_only_.SetServiceServing(kClusterHealthService, false);
  Membership::Listener listener;
  BlockIndex* index = index_.get();
  listener.advertised = [this, index](uint64_t) {
    if (index != nullptr) index->SetAdvertised(true);
    health_.SetServiceServing(kClusterHealthService, true);
    health_only_.SetServiceServing(kClusterHealthService, true);
  };
  listener.lost = [this, index] {
    if (index != nullptr) index->SetAdvertised(false);
    health_.SetServiceServing(kClusterHealthService, false);
    health_only_.SetServiceServing(kClusterHealthService, false);
  };
  if (index_) {
    listener.member_gone = [index](const MemberInfo& m) { index->PurgeMember(m); };
    index_->Start();
  }
  membership_->Start(std::move(listener));
  KVCD_ASSIGN_OR_RETURN(puller_, PrefixPuller::Create(engine_.get(), membership_.get(), config_));
  membership_seen_ = membership_.get();
  puller_seen_ = puller_.get();
  puller_ready_.store(true);
  KVCD_LOG(INFO) << "cluster: " << k.name << ", member " << k.member_id << ", incarnation "
                 << incarnation_ << ", membership "
                 << (k.membership == "dns" ? "dns " + k.dns_name
                                           : "etcd " + absl::StrJoin(k.etcd_endpoints, ","));
  return absl::OkStatus();
}

void Daemon::ReaperLoop() {
  int64_t period_ms = std::max<int64_t>(5, std::min<int64_t>(250, config_.default_lease_ms / 4));
  if (tokens_)
    period_ms = std::min(period_ms, std::max<int64_t>(5, config_.auth.reload_interval_ms));
  const auto period = std::chrono::milliseconds(period_ms);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, period);
    if (stopping_) break;
    lock.unlock();
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    ReloadCredentials();
    const int n = engine_->ExpireLeases(now);
    if (n > 0) KVCD_LOG(INFO) << "closed " << n << " sequence(s) whose lease expired";
    const int pins = engine_->ExpirePins(now);
    if (pins > 0) KVCD_LOG(INFO) << "removed " << pins << " prefix pin(s) whose ttl ran out";
    if (!engine_->backend_healthy() && !fatal_.exchange(true)) {
      // A sticky device error: stop serving, drain from another thread, exit non-zero.
      KVCD_LOG(ERROR) << "backend '" << engine_->backend_name()
                      << "' hit an unrecoverable error; NOT_SERVING";
      health_.SetServing(false);
      health_only_.SetServing(false);
      std::thread([this] { Drain(); }).detach();
    }
    lock.lock();
  }
}

void Daemon::ReloadCredentials() {
  if (tls_) {
    const std::string line = tls_->Poll();
    if (!line.empty()) KVCD_LOG(INFO) << line;
  }
  if (!tokens_) return;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  if (now < next_token_check_ns_) return;
  next_token_check_ns_ = now + config_.auth.reload_interval_ms * 1000000;
  std::string message;
  switch (tokens_->Reload(&message)) {
    case TokenStore::ReloadResult::kUnchanged:
      break;
    case TokenStore::ReloadResult::kReloaded:
      KVCD_LOG(INFO) << "auth: " << message;
      break;
    case TokenStore::ReloadResult::kFailed:
      KVCD_LOG(WARNING) << "auth: reload failed: " << message;
      break;
  }
}

void Daemon::Drain() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  // New API calls are refused before health says NOT_SERVING: a client that sees
  // NOT_SERVING and then calls must get UNAVAILABLE, never an answer (the service used to
  // start draining only after the cluster was left, and such a call could still succeed).
  if (service_) service_->StartDraining();
  health_.SetServing(false);
  health_only_.SetServing(false);
  // Leave the cluster first: peers and clients stop routing here while the calls drain.
  if (membership_) {
    membership_->Stop();
    health_.SetServiceServing(kClusterHealthService, false);
    health_only_.SetServiceServing(kClusterHealthService, false);
  }
  if (index_) index_->Stop();
  if (events_) events_->Stop();
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::milliseconds(config_.drain_timeout_ms);
  // The servers keep accepting calls while the calls in flight finish: health checks
  // answer NOT_SERVING and new API calls UNAVAILABLE (a stopped server would refuse them
  // with transport errors, or cancel them). Open decode streams end when idle and health
  // watches are ended before the stop: neither ends by itself.
  //
  // Why a drain with an idle client used to last drain_timeout_ms: gRPC's
  // Server::Shutdown(deadline) returns only once every call has finished *and every
  // connection is gone*; it sends GOAWAY and waits for the clients to close their idle
  // connections, which gRPC clients do only when they next use the channel (or never,
  // for a channel kept open with keepalive), and otherwise force-closes them at the
  // deadline. Whether a run waited therefore depended on what the connected clients did
  // next. The daemon now does the waiting itself (WaitIdle: calls and stream requests in
  // flight) and then gives Shutdown only a short grace for the last answers to go out,
  // after which idle connections are closed.
  if (service_) {  // null if Start() failed early
    service_->WaitIdle(t0 + std::chrono::milliseconds(config_.drain_timeout_ms));
  }
  const auto t_idle = std::chrono::steady_clock::now();
  health_.EndWatches();
  health_only_.EndWatches();
  constexpr auto kShutdownGrace = std::chrono::milliseconds(100);
  const auto grace = std::min(deadline, std::chrono::system_clock::now() + kShutdownGrace);
  if (server_) server_->Shutdown(grace);
  const auto t1 = std::chrono::steady_clock::now();
  if (health_server_) {
    health_server_->Shutdown(std::min(deadline, std::chrono::system_clock::now() + kShutdownGrace));
  }
  const auto t2 = std::chrono::steady_clock::now();
  if (reaper_.joinable()) reaper_.join();
  tls_.reset();  // removes the staged copies of the TLS files
  auto ms = [](auto d) {
    return absl::StrFormat("%.0f", std::chrono::duration<double, std::milli>(d).count());
  };
  KVCD_LOG(INFO) << "drain: api " << ms(t1 - t0) << " ms (calls in flight " << ms(t_idle - t0)
                 << " ms), health " << ms(t2 - t1) << " ms, reaper "
                 << ms(std::chrono::steady_clock::now() - t2) << " ms";
  {
    std::lock_guard<std::mutex> lock(mu_);
    drained_ = true;
  }
  cv_.notify_all();
}

void Daemon::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return drained_; });
}

Daemon::~Daemon() {
  Drain();
  server_.reset();
  health_server_.reset();
  executor_.reset();  // drains queued work before the engine goes away
}

}  // namespace kvcd
