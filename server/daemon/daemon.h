// Daemon: wires a config into a running kvcd — backend, engine, gRPC servers (API +
// optional health-only port), Prometheus exposer, lease reaper — and drains it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "server/cluster/block_index.h"
#include "server/cluster/event_publisher.h"
#include "server/cluster/membership.h"
#include "server/cluster/prefix_puller.h"
#include "server/config/config.h"
#include "server/engine/cache_engine.h"
#include "server/metrics/metrics.h"
#include "server/rpc/auth.h"
#include "server/rpc/health_service.h"
#include "server/rpc/service.h"
#include "server/rpc/tls.h"

namespace kvcd {

class Daemon {
 public:
  // Builds everything and starts serving. Errors: INVALID_ARGUMENT for a bad config or
  // a bad TLS / tokens file (naming the file), NOT_FOUND for an unreadable one,
  // FAILED_PRECONDITION for a non-loopback address without TLS and auth (CheckExposure),
  // UNAVAILABLE when an address cannot be bound.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const ServerConfig& config);
  ~Daemon();

  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  const std::string& health_address() const { return health_address_; }
  CacheEngine* engine() { return engine_.get(); }
  // Cluster membership (config cluster.membership etcd), or null.
  Membership* membership() { return membership_.get(); }

  // Graceful drain: health NOT_SERVING, new calls UNAVAILABLE, in-flight calls finish
  // (up to drain_timeout_ms), then the servers stop. Idempotent; thread-safe.
  void Drain();
  // Blocks until Drain() has completed.
  void Wait();
  // True if the daemon stopped because its backend failed (the process exits non-zero).
  bool fatal() const { return fatal_.load(); }

 private:
  explicit Daemon(const ServerConfig& config) : config_(config) {}
  void ReaperLoop();
  void ReloadCredentials();  // token file and TLS files, when they changed
  // Joins the cluster (config cluster:), once the API port is bound.
  absl::Status StartCluster();

  ServerConfig config_;
  std::unique_ptr<TokenStore> tokens_;        // auth.tokens_file, or null
  std::unique_ptr<TlsCredentialSource> tls_;  // tls.*, or null
  int64_t next_token_check_ns_ = 0;
  // The block index (cluster.redis_url), or null. Declared before engine_, whose trees tell
  // it of their pages, so that it is destroyed after the engine.
  std::unique_ptr<BlockIndex> index_;
  std::unique_ptr<EventPublisher> events_;  // cluster.events_endpoint, or null
  BlockObservers observers_;                // index_ and events_, told by the engine
  std::unique_ptr<CacheEngine> engine_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ThreadPool> executor_;
  std::unique_ptr<KvCacheService> service_;
  HealthService health_;       // on the API port
  HealthService health_only_;  // on the optional health-only port
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;
  std::string incarnation_;                 // new at every start (cluster: only)
  std::unique_ptr<Membership> membership_;  // cluster.membership etcd, or null
  std::unique_ptr<PrefixPuller> puller_;    // with membership_
  std::atomic<bool> puller_ready_{false};   // puller_ is set
  // The same pointers for the metrics thread, read once puller_ready_ is true.
  const Membership* membership_seen_ = nullptr;
  const PrefixPuller* puller_seen_ = nullptr;
  std::string grpc_address_, metrics_address_, health_address_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::atomic<bool> fatal_{false};
  bool drained_ = false;
  std::thread reaper_;
};

}  // namespace kvcd
