#include "server/rpc/service.h"

#include <chrono>

#include "absl/strings/str_cat.h"

#include "server/rpc/status_mapping.h"

namespace kvcd {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const absl::Status& DrainingStatus() {
  static const absl::Status s =
      absl::UnavailableError("kvcd is draining; retry on another replica");
  return s;
}

}  // namespace

KvCacheService::KvCacheService(CacheEngine* engine, Metrics* metrics, ThreadPool* executor)
    : engine_(engine),
      metrics_(metrics),
      executor_(executor),
      channels_(
          [this](const v1::AttentionDecodeRequest& req, v1::AttentionDecodeResponse* resp) {
            const auto t0 = std::chrono::steady_clock::now();
            absl::Status s = Decode(req, resp);
            metrics_->ObserveRpc("DecodeChannel", s.code(), SecondsSince(t0));
            return s;
          },
          DecodeChannels::Options{engine->config().decode_channel_spin_us, 20, 64}) {}

template <class Fn>
grpc::ServerUnaryReactor* KvCacheService::Run(const char* method, grpc::CallbackServerContext* ctx,
                                              Fn fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const auto t0 = std::chrono::steady_clock::now();
  if (draining_.load()) {
    metrics_->ObserveRpc(method, DrainingStatus().code(), 0);
    reactor->Finish(ToGrpcStatus(DrainingStatus()));
    return reactor;
  }
  executor_->Submit([this, reactor, method, t0, ctx, fn = std::move(fn)]() mutable {
    absl::Status s =
        ctx->IsCancelled() ? absl::CancelledError("call cancelled by the client") : fn();
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      ctx->AddTrailingMetadata("retry-after-ms", std::to_string(kRetryAfterMs));
    }
    metrics_->ObserveRpc(method, s.code(), SecondsSince(t0));
    reactor->Finish(ToGrpcStatus(s));
  });
  return reactor;
}

#define KVCD_UNARY(Method, Req, Resp)                                                    \
  grpc::ServerUnaryReactor* KvCacheService::Method(grpc::CallbackServerContext* ctx,     \
                                                   const v1::Req* req, v1::Resp* resp) { \
    return Run(#Method, ctx, [this, req, resp] { return engine_->Method(*req, resp); }); \
  }
KVCD_UNARY(RegisterModel, RegisterModelRequest, RegisterModelResponse)
KVCD_UNARY(ListModels, ListModelsRequest, ListModelsResponse)
KVCD_UNARY(Put, PutRequest, PutResponse)
KVCD_UNARY(Match, MatchRequest, MatchResponse)
KVCD_UNARY(OpenSequence, OpenSequenceRequest, OpenSequenceResponse)
KVCD_UNARY(CloseSequence, CloseSequenceRequest, CloseSequenceResponse)
KVCD_UNARY(RenewLease, RenewLeaseRequest, RenewLeaseResponse)
KVCD_UNARY(Append, AppendRequest, AppendResponse)
KVCD_UNARY(FetchPages, FetchPagesRequest, FetchPagesResponse)
KVCD_UNARY(PushPages, PushPagesRequest, PushPagesResponse)
KVCD_UNARY(Stats, StatsRequest, StatsResponse)
KVCD_UNARY(RegisterBuffer, RegisterBufferRequest, RegisterBufferResponse)
KVCD_UNARY(UnregisterBuffer, UnregisterBufferRequest, UnregisterBufferResponse)
KVCD_UNARY(RenewBuffer, RenewBufferRequest, RenewBufferResponse)
KVCD_UNARY(NcclConnect, NcclConnectRequest, NcclConnectResponse)
KVCD_UNARY(NcclDisconnect, NcclDisconnectRequest, NcclDisconnectResponse)
#undef KVCD_UNARY

grpc::ServerUnaryReactor* KvCacheService::OpenDecodeChannel(
    grpc::CallbackServerContext* ctx, const v1::OpenDecodeChannelRequest* req,
    v1::OpenDecodeChannelResponse* resp) {
  return Run("OpenDecodeChannel", ctx, [this, req, resp]() -> absl::Status {
    const absl::StatusOr<int64_t> lease = engine_->leases().Grant(req->lease_ms());
    if (!lease.ok()) return lease.status();
    absl::StatusOr<uint64_t> id = channels_.Open(req->shm_name(), *lease);
    if (!id.ok()) return id.status();
    resp->set_channel_id(*id);
    resp->set_lease_ms(*lease);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvCacheService::CloseDecodeChannel(
    grpc::CallbackServerContext* ctx, const v1::CloseDecodeChannelRequest* req,
    v1::CloseDecodeChannelResponse*) {
  return Run("CloseDecodeChannel", ctx,
             [this, req] { return channels_.Close(req->channel_id()); });
}

absl::Status KvCacheService::Decode(const v1::AttentionDecodeRequest& req,
                                    v1::AttentionDecodeResponse* resp) {
  absl::Status s = engine_->AttentionDecode(req, resp);
  if (s.ok()) metrics_->ObserveKernel(resp->kernel_seconds());
  return s;
}

grpc::ServerUnaryReactor* KvCacheService::AttentionDecode(grpc::CallbackServerContext* ctx,
                                                          const v1::AttentionDecodeRequest* req,
                                                          v1::AttentionDecodeResponse* resp) {
  return Run("AttentionDecode", ctx, [this, req, resp] { return Decode(*req, resp); });
}

// One stream per decode worker: read a request, run it on the executor, write the
// answer, read the next. A failed request is answered with its status in the stream
// message; the stream itself stays open.
class DecodeStreamReactor final
    : public grpc::ServerBidiReactor<v1::AttentionDecodeRequest,
                                     v1::AttentionDecodeStreamResponse> {
 public:
  DecodeStreamReactor(KvCacheService* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    StartRead(&req_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // client half-closed (or the call broke)
      Finish(grpc::Status::OK);
      return;
    }
    if (service_->draining_.load()) {
      Finish(ToGrpcStatus(DrainingStatus()));
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    service_->executor_->Submit([this, t0] {
      resp_.Clear();
      absl::Status s = service_->Decode(req_, resp_.mutable_response());
      resp_.set_request_id(req_.request_id());
      if (!s.ok()) {
        resp_.clear_response();
        resp_.set_error_code(static_cast<int>(s.code()));
        resp_.set_error_message(std::string(s.message()));
      }
      service_->metrics_->ObserveRpc("AttentionDecodeStream", s.code(), SecondsSince(t0));
      StartWrite(&resp_);
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "stream write failed"));
      return;
    }
    StartRead(&req_);
  }

  void OnDone() override { delete this; }

 private:
  KvCacheService* service_;
  grpc::CallbackServerContext* ctx_;
  v1::AttentionDecodeRequest req_;
  v1::AttentionDecodeStreamResponse resp_;
};

grpc::ServerBidiReactor<v1::AttentionDecodeRequest, v1::AttentionDecodeStreamResponse>*
KvCacheService::AttentionDecodeStream(grpc::CallbackServerContext* ctx) {
  return new DecodeStreamReactor(this, ctx);
}

}  // namespace kvcd
