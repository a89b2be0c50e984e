// Prometheus metrics (prometheus-cpp). Counters and gauges of the cache are read from
// the engine at scrape time (no double bookkeeping); RPC and kernel latencies are
// histograms observed by the service. Names follow Prometheus rules: kvcd_ prefix,
// base units (seconds, bytes), _total for counters, bounded labels (method, code,
// model, format). See docs/operating.md "Metrics".
//
// Thread safety: ObserveRpc / ObserveKernel are thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/exposer.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/engine/cache_engine.h"

namespace kvcd {

// What kvcd_build_info{version, commit, backend, cuda} 1 says about the process.
struct BuildLabels {
  std::string version;  // KVCD_VERSION
  std::string commit;   // KVCD_COMMIT: short hash, "-dirty", or "unknown"
  std::string backend;  // the backend serving: cpu | cuda
  bool cuda = false;    // whether this build has the CUDA backend
};

class Metrics {
 public:
  // Also exports kvcd_build_info (the labels above, value 1) and
  // kvcd_process_start_time_seconds (Unix time of this constructor): a restart is a change of
  // the start time (deploy/prometheus/kvcd-rules.yaml, KvcdRestarted).
  Metrics(const CacheEngine* engine, const BuildLabels& build);
  ~Metrics();

  // More metrics read at scrape time (the cluster's). REQUIRES: called before Serve.
  void AddCollectable(std::shared_ptr<prometheus::Collectable> c) {
    extra_.push_back(std::move(c));
  }

  // Starts the HTTP exposer on `address` (host:port; port 0 picks one). Returns the port.
  absl::StatusOr<int> Serve(const std::string& address);

  void ObserveRpc(const std::string& method, absl::StatusCode code, double seconds);
  // The latency histogram ObserveRpc feeds for one (method, code): a hot path that observes
  // the same pair on every call keeps it instead of looking it up each time. Valid for the
  // lifetime of this Metrics; its Observe is thread-safe.
  prometheus::Histogram* RpcHistogram(const std::string& method, absl::StatusCode code);
  void ObserveKernel(double seconds);

  // The text exposition of all metrics (what /metrics serves).
  std::string Render() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> cache_collector_;
  std::vector<std::shared_ptr<prometheus::Collectable>> extra_;  // AddCollectable
  prometheus::Family<prometheus::Histogram>* rpc_seconds_;
  prometheus::Histogram* kernel_seconds_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace kvcd
