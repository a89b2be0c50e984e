#include "server/rpc/service.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/phase_times.h"
#include "common/status_macros.h"
#include "server/rpc/reactor_order.h"
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

// The request of a unary call from its bytes. A body that does not parse is the client's
// error: INVALID_ARGUMENT that says so (gRPC's typed handler answered UNIMPLEMENTED with an
// empty message).
absl::Status ParseRequest(const char* method, const grpc::ByteBuffer& in,
                          google::protobuf::Message* req) {
  grpc::ByteBuffer bytes(in);  // Deserialize consumes its buffer; the copy shares the slices
  const size_t size = bytes.Length();
  if (grpc::SerializationTraits<google::protobuf::Message>::Deserialize(&bytes, req).ok()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      method, ": the request body (", size, " bytes) is not a valid ", req->GetTypeName(),
      " (malformed protobuf encoding, or a string field that is not UTF-8)"));
}

absl::Status SerializeResponse(const char* method, const google::protobuf::Message& resp,
                               grpc::ByteBuffer* out) {
  bool own = false;
  if (grpc::SerializationTraits<google::protobuf::Message>::Serialize(resp, out, &own).ok()) {
    return absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat(method, ": the response (", resp.ByteSizeLong(),
                                          " bytes) could not be serialized"));
}

}  // namespace

KvCacheService::KvCacheService(CacheEngine* engine, Metrics* metrics, ThreadPool* executor,
                               const TokenStore* tokens)
    : engine_(engine),
      metrics_(metrics),
      executor_(executor),
      tokens_(tokens),
      authz_([engine](uint64_t id) { return engine->LookupSequence(id); },
             [engine](uint64_t id) -> absl::StatusOr<std::string> {
               absl::StatusOr<PrefixPins::Pin> pin = engine->LookupPin(id);
               if (!pin.ok()) return pin.status();
               return pin->tenant;
             }),
      channels_(engine, DecodeChannels::Options{engine->config().decode_channel_spin_us, 64}) {}

// What a decode channel asks before each request: the token that opened the channel,
// resolved again for every request (a revoked token stops working), may use every sequence
// of it; the sequences found go down to the engine with the request. Each answer is
// observed like a call's.
//
// The channel counts against the max_decode_channels quota of each tenant the opening
// token grants (a token of every tenant, or no auth: the default tenant "") from Open
// until it ends, whichever way it ends.
class ChannelAdmission final : public DecodeAdmission {
 public:
  ChannelAdmission(KvCacheService* service, std::optional<std::string> authorization,
                   std::vector<std::string> tenants)
      : service_(service), authorization_(std::move(authorization)), tenants_(std::move(tenants)) {}
  ~ChannelAdmission() override { Ended(); }

  // What a principal's channels are charged to.
  static std::vector<std::string> TenantsOf(const Principal& p) {
    if (p.unrestricted || p.all_tenants) return {""};
    return std::vector<std::string>(p.tenants.begin(), p.tenants.end());
  }

  void Ended() override {
    if (!released_.exchange(true)) service_->engine_->ledger().ReleaseDecodeChannel(tenants_);
  }

  absl::StatusOr<FoundSequences> Admit(const v1::AttentionDecodeRequest& req) override {
    absl::StatusOr<std::shared_ptr<const Principal>> now = service_->Authenticate(authorization_);
    if (!now.ok()) return now.status();
    FoundSequences found;
    if (absl::Status s = service_->authz_.Check(**now, req, &found); !s.ok()) return s;
    return found;
  }

  void Answered(const absl::Status& s, double seconds,
                const v1::AttentionDecodeResponse& resp) override {
    static const int kMetrics = PhaseTimes::Phase("daemon.service.metrics");
    PhaseLap lap;
    if (s.ok()) {  // the per-layer loop's case: no label lookup per request
      service_->metrics_->ObserveKernel(resp.kernel_seconds());
      prometheus::Histogram* h = service_->channel_ok_seconds_.load(std::memory_order_acquire);
      if (h == nullptr) {
        h = service_->metrics_->RpcHistogram("DecodeChannel", absl::StatusCode::kOk);
        service_->channel_ok_seconds_.store(h, std::memory_order_release);
      }
      h->Observe(seconds);
    } else {
      service_->metrics_->ObserveRpc("DecodeChannel", s.code(), seconds);
    }
    lap.Mark(kMetrics);
  }

 private:
  KvCacheService* const service_;
  const std::optional<std::string> authorization_;
  const std::vector<std::string> tenants_;  // charged one channel each (taken before Open)
  std::atomic<bool> released_{false};
};

std::optional<std::string> KvCacheService::AuthorizationOf(grpc::CallbackServerContext* ctx) {
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return std::nullopt;
  return std::string(it->second.data(), it->second.size());
}

absl::StatusOr<std::shared_ptr<const Principal>> KvCacheService::Authenticate(
    const std::optional<std::string>& authorization) const {
  if (tokens_ == nullptr) return Principal::Unrestricted();
  return kvcd::Authenticate(*tokens_->current(), authorization ? &*authorization : nullptr);
}

absl::StatusOr<std::shared_ptr<const Principal>> KvCacheService::Authenticate(
    grpc::CallbackServerContext* ctx) const {
  if (tokens_ == nullptr) return Principal::Unrestricted();
  return Authenticate(AuthorizationOf(ctx));
}

template <class Req, class Resp, class Fn>
grpc::ServerUnaryReactor* KvCacheService::Run(const char* method, grpc::CallbackServerContext* ctx,
                                              const grpc::ByteBuffer* in, grpc::ByteBuffer* out,
                                              Fn fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const auto t0 = std::chrono::steady_clock::now();
  // Counted before the draining check (both seq_cst), so that WaitIdle cannot miss a call
  // that got past the check.
  in_flight_.fetch_add(1);
  if (draining_.load()) {
    metrics_->ObserveRpc(method, DrainingStatus().code(), 0);
    reactor->Finish(ToGrpcStatus(DrainingStatus()));
    CallDone();
    return reactor;
  }
  absl::StatusOr<std::shared_ptr<const Principal>> principal = Authenticate(ctx);
  if (!principal.ok()) {
    metrics_->ObserveRpc(method, principal.status().code(), SecondsSince(t0));
    reactor->Finish(ToGrpcStatus(principal.status()));
    CallDone();
    return reactor;
  }
  executor_->Submit([this, reactor, method, t0, ctx, in, out, p = std::move(*principal),
                     fn = std::move(fn)]() mutable {
    absl::Status s;
    if (ctx->IsCancelled()) {
      s = absl::CancelledError("call cancelled by the client");
    } else {
      Req req;
      Resp resp;
      s = ParseRequest(method, *in, &req);
      if (s.ok()) s = fn(*p, req, &resp);
      if (s.ok()) s = SerializeResponse(method, resp, out);
    }
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      // gRPC's standard retry hint (honoured by gRPC's own retry policy).
      ctx->AddTrailingMetadata(kRetryPushbackKey, std::to_string(kRetryAfterMs));
    }
    metrics_->ObserveRpc(method, s.code(), SecondsSince(t0));
    reactor->Finish(ToGrpcStatus(s));
    CallDone();
  });
  return reactor;
}

void KvCacheService::CallDone() {
  if (in_flight_.fetch_sub(1) == 1 && draining_.load()) {
    std::lock_guard<std::mutex> lock(idle_mu_);
    idle_cv_.notify_all();
  }
}

bool KvCacheService::WaitIdle(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(idle_mu_);
  return idle_cv_.wait_until(lock, deadline, [this] { return in_flight_.load() == 0; });
}

// Authorization runs before routing, so a refused call changes nothing stored. `then` runs
// after the engine answered OK (with p, req and resp in scope): what the caller may see of
// the answer, or the binding of a created data-plane object to its token (authorizer.h).
#define KVCD_UNARY_THEN(Method, Req, Resp, then)                                             \
  grpc::ServerUnaryReactor* KvCacheService::Method(                                          \
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in, grpc::ByteBuffer* out) { \
    return Run<v1::Req, v1::Resp>(                                                           \
        #Method, ctx, in, out,                                                               \
        [this](const Principal& p, const v1::Req& req, v1::Resp* resp) -> absl::Status {     \
          if (absl::Status s = authz_.Check(p, req); !s.ok()) return s;                      \
          absl::Status s = engine_->Method(req, resp);                                       \
          if (s.ok()) {                                                                      \
            then;                                                                            \
          }                                                                                  \
          return s;                                                                          \
        });                                                                                  \
  }
#define KVCD_UNARY(Method, Req, Resp) KVCD_UNARY_THEN(Method, Req, Resp, (void)p)
KVCD_UNARY(RegisterModel, RegisterModelRequest, RegisterModelResponse)
KVCD_UNARY(Put, PutRequest, PutResponse)
KVCD_UNARY(Match, MatchRequest, MatchResponse)
KVCD_UNARY(OpenSequence, OpenSequenceRequest, OpenSequenceResponse)
KVCD_UNARY(PushPages, PushPagesRequest, PushPagesResponse)
KVCD_UNARY(PinPrefix, PinPrefixRequest, PinPrefixResponse)
KVCD_UNARY(UnpinPrefix, UnpinPrefixRequest, UnpinPrefixResponse)
KVCD_UNARY(RenewBuffer, RenewBufferRequest, RenewBufferResponse)
#undef KVCD_UNARY
// What the daemon's state shows is scoped to the caller's tenants (Authorizer::Scope), the
// prefix pins of Stats included.
KVCD_UNARY_THEN(ListModels, ListModelsRequest, ListModelsResponse, authz_.Scope(p, resp))
KVCD_UNARY_THEN(Stats, StatsRequest, StatsResponse, authz_.Scope(p, resp))
// Data-plane objects are bound to the token that created them (authorizer.h).
KVCD_UNARY_THEN(RegisterBuffer, RegisterBufferRequest, RegisterBufferResponse,
                authz_.Bind(Authorizer::Object::kBuffer, resp->buffer_id(), p))
KVCD_UNARY_THEN(UnregisterBuffer, UnregisterBufferRequest, UnregisterBufferResponse,
                authz_.Unbind(Authorizer::Object::kBuffer, req.buffer_id()))
KVCD_UNARY_THEN(NcclConnect, NcclConnectRequest, NcclConnectResponse,
                authz_.Bind(Authorizer::Object::kCommunicator, resp->communicator_id(), p))
KVCD_UNARY_THEN(NcclDisconnect, NcclDisconnectRequest, NcclDisconnectResponse,
                authz_.Unbind(Authorizer::Object::kCommunicator, req.communicator_id()))
#undef KVCD_UNARY_THEN

grpc::ServerUnaryReactor* KvCacheService::PullPrefix(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* in,
                                                     grpc::ByteBuffer* out) {
  // The caller's own credentials go to the peer (docs/cluster.md): taken here, on the
  // reactor's thread, while the call's metadata is at hand.
  std::string authorization = AuthorizationOf(ctx).value_or("");
  return Run<v1::PullPrefixRequest, v1::PullPrefixResponse>(
      "PullPrefix", ctx, in, out,
      [this, authorization = std::move(authorization)](
          const Principal& p, const v1::PullPrefixRequest& req,
          v1::PullPrefixResponse* resp) -> absl::Status {
        if (absl::Status s = authz_.Check(p, req); !s.ok()) return s;
        if (!pull_) {
          return absl::FailedPreconditionError(
              "PullPrefix needs a cluster: this daemon's config has no cluster section with "
              "membership etcd (docs/cluster.md)");
        }
        return pull_(req, authorization, resp);
      });
}

// Sequence-scoped calls: the sequences the authorizer found go on to the engine.
#define KVCD_SEQUENCE_UNARY(Method, Req, Resp)                                               \
  grpc::ServerUnaryReactor* KvCacheService::Method(                                          \
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in, grpc::ByteBuffer* out) { \
    return Run<v1::Req, v1::Resp>(                                                           \
        #Method, ctx, in, out,                                                               \
        [this](const Principal& p, const v1::Req& req, v1::Resp* resp) -> absl::Status {     \
          FoundSequences found;                                                              \
          if (absl::Status s = authz_.Check(p, req, &found); !s.ok()) return s;              \
          return engine_->Method(req, resp, found);                                          \
        });                                                                                  \
  }
KVCD_SEQUENCE_UNARY(CloseSequence, CloseSequenceRequest, CloseSequenceResponse)
KVCD_SEQUENCE_UNARY(CommitSequence, CommitSequenceRequest, CommitSequenceResponse)
KVCD_SEQUENCE_UNARY(ForkSequence, ForkSequenceRequest, ForkSequenceResponse)
KVCD_SEQUENCE_UNARY(RenewLease, RenewLeaseRequest, RenewLeaseResponse)
KVCD_SEQUENCE_UNARY(Append, AppendRequest, AppendResponse)
KVCD_SEQUENCE_UNARY(FetchPages, FetchPagesRequest, FetchPagesResponse)
#undef KVCD_SEQUENCE_UNARY

grpc::ServerUnaryReactor* KvCacheService::OpenDecodeChannel(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* in,
                                                            grpc::ByteBuffer* out) {
  return Run<v1::OpenDecodeChannelRequest, v1::OpenDecodeChannelResponse>(
      "OpenDecodeChannel", ctx, in, out,
      [this, ctx](const Principal& p, const v1::OpenDecodeChannelRequest& req,
                  v1::OpenDecodeChannelResponse* resp) -> absl::Status {
        if (absl::Status s = authz_.Check(p, req); !s.ok()) return s;
        const absl::StatusOr<int64_t> lease = engine_->leases().Grant(req.lease_ms());
        if (!lease.ok()) return lease.status();
        // Requests on the channel run with the token that opened it, resolved again for
        // every request (a revoked token stops working). The channel is charged to the
        // token's tenants first; a refused Open gives the charge back (the admission's
        // destructor).
        std::vector<std::string> tenants = ChannelAdmission::TenantsOf(p);
        if (absl::Status s = engine_->ledger().TakeDecodeChannel(tenants); !s.ok()) return s;
        absl::StatusOr<uint64_t> id = channels_.Open(
            req.shm_name(), *lease,
            std::make_unique<ChannelAdmission>(this, AuthorizationOf(ctx), std::move(tenants)));
        if (!id.ok()) return id.status();
        authz_.Bind(Authorizer::Object::kChannel, *id, p);
        resp->set_channel_id(*id);
        resp->set_lease_ms(*lease);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvCacheService::CloseDecodeChannel(grpc::CallbackServerContext* ctx,
                                                             const grpc::ByteBuffer* in,
                                                             grpc::ByteBuffer* out) {
  return Run<v1::CloseDecodeChannelRequest, v1::CloseDecodeChannelResponse>(
      "CloseDecodeChannel", ctx, in, out,
      [this](const Principal& p, const v1::CloseDecodeChannelRequest& req,
             v1::CloseDecodeChannelResponse* resp) -> absl::Status {
        if (absl::Status s = authz_.Check(p, req); !s.ok()) return s;
        absl::Status s = channels_.Close(req.channel_id());
        if (s.ok()) authz_.Unbind(Authorizer::Object::kChannel, req.channel_id());
        return s;
      });
}

absl::Status KvCacheService::Decode(const v1::AttentionDecodeRequest& req,
                                    v1::AttentionDecodeResponse* resp,
                                    const FoundSequences& found) {
  absl::Status s = engine_->AttentionDecode(req, resp, found);
  if (s.ok()) metrics_->ObserveKernel(resp->kernel_seconds());
  return s;
}

grpc::ServerUnaryReactor* KvCacheService::AttentionDecode(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* in,
                                                          grpc::ByteBuffer* out) {
  return Run<v1::AttentionDecodeRequest, v1::AttentionDecodeResponse>(
      "AttentionDecode", ctx, in, out,
      [this](const Principal& p, const v1::AttentionDecodeRequest& req,
             v1::AttentionDecodeResponse* resp) -> absl::Status {
        FoundSequences found;
        if (absl::Status s = authz_.Check(p, req, &found); !s.ok()) return s;
        return Decode(req, resp, found);
      });
}

// One stream per decode worker: read a request, run it on the executor, write the
// answer, read the next. A failed request is answered with its status in the stream
// message; the stream itself stays open. A message that is not an AttentionDecodeRequest
// ends the stream with INVALID_ARGUMENT (the requests after it would be unanswerable).
// A drain ends a stream that waits for its next request at once (Drain), and one that is
// running a request after its answer, both with UNAVAILABLE.
class DecodeStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  DecodeStreamReactor(KvCacheService* service, grpc::CallbackServerContext* ctx)
      : service_(service) {
    // The stream runs with the token of its opening call, resolved again for every
    // request (a token revoked by a reload stops working on open streams too).
    authorization_ = KvCacheService::AuthorizationOf(ctx);
    absl::StatusOr<std::shared_ptr<const Principal>> p = service_->Authenticate(authorization_);
    if (!p.ok()) {
      service_->metrics_->ObserveRpc("AttentionDecodeStream", p.status().code(), 0);
      FinishOnce(ToGrpcStatus(p.status()));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(service_->streams_mu_);
      service_->streams_.insert(this);
      registered_ = true;
    }
    if (service_->draining_.load()) {
      FinishOnce(ToGrpcStatus(DrainingStatus()));
      return;
    }
    Read();
  }

  // Called by StartDraining (under streams_mu_): ends the stream now if it is waiting
  // for a request; a running request ends it after its answer (OnWriteDone).
  void Drain() {
    std::lock_guard<std::mutex> lock(mu_);
    if (reading_) FinishLocked(ToGrpcStatus(DrainingStatus()));
  }

  void OnReadDone(bool ok) override {
    TakeFromGrpc(this);
    // Counted before the draining check, like a unary call (Run), so that a drain's
    // WaitIdle cannot miss a request that got past it.
    service_->in_flight_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      bool end = true;
      if (finished_) {
        // ended by Drain while the read was pending
      } else if (!ok) {  // client half-closed (or the call broke)
        FinishLocked(grpc::Status::OK);
      } else if (service_->draining_.load()) {
        FinishLocked(ToGrpcStatus(DrainingStatus()));
      } else {
        end = false;
      }
      if (end) {
        service_->CallDone();
        return;
      }
    }
    ++messages_;
    const size_t bytes = in_.Length();
    const bool parsed =
        grpc::SerializationTraits<v1::AttentionDecodeRequest>::Deserialize(&in_, &req_).ok();
    in_.Clear();
    if (!parsed) {
      const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
          "stream message ", messages_, " (", bytes,
          " bytes) is not a valid AttentionDecodeRequest; the stream is closed, the requests "
          "after it were not read"));
      service_->metrics_->ObserveRpc("AttentionDecodeStream", bad.code(), 0);
      FinishOnce(ToGrpcStatus(bad));
      service_->CallDone();
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    service_->executor_->Submit([this, t0] {
      resp_.Clear();
      absl::StatusOr<std::shared_ptr<const Principal>> p = service_->Authenticate(authorization_);
      FoundSequences found;
      absl::Status s = p.ok() ? service_->authz_.Check(**p, req_, &found) : p.status();
      if (s.ok()) s = service_->Decode(req_, resp_.mutable_response(), found);
      resp_.set_request_id(req_.request_id());
      if (!s.ok()) {
        resp_.clear_response();
        resp_.set_error_code(static_cast<int>(s.code()));
        resp_.set_error_message(std::string(s.message()));
      }
      service_->metrics_->ObserveRpc("AttentionDecodeStream", s.code(), SecondsSince(t0));
      service_->CallDone();
      out_.Clear();
      bool own = false;
      if (!grpc::SerializationTraits<v1::AttentionDecodeStreamResponse>::Serialize(resp_, &out_,
                                                                                   &own)
               .ok()) {
        FinishOnce(
            grpc::Status(grpc::StatusCode::INTERNAL, "cannot serialize the stream response"));
        return;
      }
      HandToGrpc(this);
      StartWrite(&out_);
    });
  }

  void OnWriteDone(bool ok) override {
    TakeFromGrpc(this);
    if (!ok) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "stream write failed"));
      return;
    }
    if (service_->draining_.load()) {
      FinishOnce(ToGrpcStatus(DrainingStatus()));
      return;
    }
    Read();
  }

  void OnDone() override {
    TakeFromGrpc(this);
    if (registered_) {
      std::lock_guard<std::mutex> lock(service_->streams_mu_);
      service_->streams_.erase(this);
    }
    delete this;
  }

 private:
  void Read() {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    reading_ = true;
    HandToGrpc(this);
    StartRead(&in_);
  }
  void FinishOnce(const grpc::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(s);
  }
  void FinishLocked(const grpc::Status& s) {
    if (finished_) return;
    finished_ = true;
    HandToGrpc(this);
    Finish(s);
  }

  KvCacheService* service_;
  std::optional<std::string> authorization_;
  bool registered_ = false;
  std::mutex mu_;
  bool reading_ = false;   // a StartRead is pending (the stream is idle)
  bool finished_ = false;  // Finish was called
  int64_t messages_ = 0;
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;
  v1::AttentionDecodeRequest req_;
  v1::AttentionDecodeStreamResponse resp_;
};

void KvCacheService::StartDraining() {
  draining_.store(true);
  channels_.CloseAll();
  std::lock_guard<std::mutex> lock(streams_mu_);
  for (DecodeStreamReactor* s : streams_) s->Drain();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::AttentionDecodeStream(
    grpc::CallbackServerContext* ctx) {
  return new DecodeStreamReactor(this, ctx);
}

}  // namespace kvcd
