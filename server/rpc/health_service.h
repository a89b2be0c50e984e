// grpc.health.v1.Health served with the callback API. The status applies to the whole
// server ("") and to "kvcd.v1.KvCache"; other service names get NOT_FOUND on Check and
// SERVICE_UNKNOWN on Watch. Watch streams the current status and every change.
// Thread safety: SetServing is thread-safe.
#pragma once

#include <mutex>
#include <set>

#include "absl/base/thread_annotations.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvcd {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  HealthService() = default;
  ~HealthService() override;

  void SetServing(bool serving);
  bool serving() const;
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
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  std::set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcd
