#include "server/rpc/health_service.h"

#include <string>

#include "server/rpc/reactor_order.h"

namespace kvcd {
namespace {

using grpc::health::v1::HealthCheckResponse;

bool ServerWide(const std::string& name) { return name.empty() || name == "kvcd.v1.KvCache"; }

}  // namespace

// One Watch stream. Writes are serialized: a change that arrives while a write is in
// flight is sent when that write completes (only the latest status matters).
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService* owner, std::string service) : owner_(owner), service_(std::move(service)) {
    std::lock_guard<std::mutex> lock(owner_->mu_);
    owner_->watchers_.insert(this);
    SendLocked();
  }

  const std::string& service() const { return service_; }

  // Sends the service's current status. REQUIRES: owner_->mu_ held.
  void SendLocked() {
    latest_ = owner_->StatusLocked(service_);
    if (writing_ || done_) {
      dirty_ = true;
      return;
    }
    writing_ = true;
    resp_.set_status(latest_);
    HandToGrpc(this);
    StartWrite(&resp_);
  }

  void OnWriteDone(bool ok) override {
    TakeFromGrpc(this);
    std::lock_guard<std::mutex> lock(owner_->mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "watch write failed"));
      return;
    }
    if (dirty_ && !done_) {
      dirty_ = false;
      writing_ = true;
      resp_.set_status(latest_);
      if (finish_after_write_) {  // the last status, then the end of the stream
        done_ = true;
        owner_->watchers_.erase(this);
        HandToGrpc(this);
        StartWriteAndFinish(&resp_, grpc::WriteOptions(), final_status_);
        return;
      }
      HandToGrpc(this);
      StartWrite(&resp_);
      return;
    }
    if (finish_after_write_) FinishLocked(final_status_);
  }

  // Ends the stream once the latest status is written: a change that is still waiting
  // behind a write in flight (NOT_SERVING right after the first SERVING, under load) reaches
  // the client before the stream's status. REQUIRES: owner_->mu_ held.
  void FinishAfterWritesLocked(const grpc::Status& s) {
    if (done_) return;
    if (!writing_) {
      FinishLocked(s);
      return;
    }
    finish_after_write_ = true;
    final_status_ = s;
  }

  void OnCancel() override {
    TakeFromGrpc(this);
    std::lock_guard<std::mutex> lock(owner_->mu_);
    FinishLocked(grpc::Status::CANCELLED);
  }

  void FinishLocked(const grpc::Status& s) {
    if (done_) return;
    done_ = true;
    owner_->watchers_.erase(this);
    HandToGrpc(this);
    Finish(s);
  }

  void OnDone() override {
    TakeFromGrpc(this);
    delete this;
  }

 private:
  HealthService* owner_;
  const std::string service_;
  HealthCheckResponse resp_;
  HealthCheckResponse::ServingStatus latest_ = HealthCheckResponse::UNKNOWN;
  bool writing_ = false, dirty_ = false, done_ = false, finish_after_write_ = false;
  grpc::Status final_status_;
};

HealthService::~HealthService() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Watcher* w : std::set<Watcher*>(watchers_)) w->FinishLocked(grpc::Status::CANCELLED);
}

HealthCheckResponse::ServingStatus HealthService::StatusLocked(const std::string& service) const {
  bool serving = serving_;
  if (!ServerWide(service)) {
    const auto it = services_.find(service);
    if (it == services_.end()) return HealthCheckResponse::SERVICE_UNKNOWN;
    serving = it->second;
  }
  return serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetServing(bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  if (serving_ == serving) return;
  serving_ = serving;
  for (Watcher* w : watchers_) {
    if (ServerWide(w->service())) w->SendLocked();
  }
}

void HealthService::SetServiceServing(const std::string& service, bool serving) {
  if (ServerWide(service)) {
    SetServing(serving);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = services_.find(service);
  if (it != services_.end() && it->second == serving) return;
  services_[service] = serving;
  for (Watcher* w : watchers_) {
    if (w->service() == service) w->SendLocked();
  }
}

void HealthService::EndWatches() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Watcher* w : std::set<Watcher*>(watchers_)) {
    w->FinishAfterWritesLocked(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvcd is shutting down"));
  }
}

bool HealthService::serving() const {
  std::lock_guard<std::mutex> lock(mu_);
  return serving_;
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* ctx,
                                               const grpc::health::v1::HealthCheckRequest* req,
                                               HealthCheckResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  HealthCheckResponse::ServingStatus status;
  std::string known = "'', 'kvcd.v1.KvCache'";
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = StatusLocked(req->service());
    for (const auto& [name, serving] : services_) known += ", '" + name + "'";
  }
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service '" + req->service() +
                                                                  "'; this kvcd reports " + known));
    return reactor;
  }
  resp->set_status(status);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req) {
  return new Watcher(this, req->service());
}

}  // namespace kvcd
