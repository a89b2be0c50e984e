// grpc.health.v1.Health served with the callback API. SetServing's status applies to the
// whole server ("") and to "kvcd.v1.KvCache". Further names (a cluster member's
// "kvcd.cluster": advertised in its cluster or not) have a status of their own once
// SetServiceServing named them. Other names get NOT_FOUND on Check and SERVICE_UNKNOWN on
// Watch (a Watch of a name that appears later gets its status then). Watch streams the
// current status and every change. Thread safety: the setters are thread-safe.
#pragma once

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvcd {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  HealthService() = default;
  ~HealthService() override;

  void SetServing(bool serving);
  bool serving() const;
  // The status of `service` (not "" or "kvcd.v1.KvCache"), known from now on.
  void SetServiceServing(const std::string& service, bool serving);
  // Ends every Watch stream with UNAVAILABLE once its latest status is written. A watch
  // never ends by itself, so the daemon calls this before stopping its server, which
  // would otherwise wait for open watches until the drain deadline.
  void EndWatches();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const grpc::health::v1::HealthCheckRequest* req,
                                  grpc::health::v1::HealthCheckResponse* resp) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req) override;

  class Watcher;

 private:
  friend class Watcher;
  mutable std::mutex mu_;
  grpc::health::v1::HealthCheckResponse::ServingStatus StatusLocked(
      const std::string& service) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, bool> services_ ABSL_GUARDED_BY(mu_);  // SetServiceServing's
  std::set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcd
