#include "client/client.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/reachability.h"

namespace kvcd {

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.error_code())),
                      s.error_message());
}

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  if (s.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", path, "' is not PEM (no '-----BEGIN' line)"));
  }
  return s;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeCredentials(const ClientOptions& o) {
  if (!o.UsesTls()) return grpc::InsecureChannelCredentials();
  if (o.tls_client_cert_file.empty() != o.tls_client_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_client_cert_file and tls_client_key_file go together (mutual TLS needs both)");
  }
  grpc::SslCredentialsOptions ssl;
  if (!o.tls_root_ca_file.empty()) {
    auto ca = ReadPem(o.tls_root_ca_file, "TLS root CA file");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = std::move(*ca);
  }
  if (!o.tls_client_cert_file.empty()) {
    auto cert = ReadPem(o.tls_client_cert_file, "TLS client certificate file");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(o.tls_client_key_file, "TLS client key file");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = std::move(*cert);
    ssl.pem_private_key = std::move(*key);
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read token file '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string t(absl::StripAsciiWhitespace(ss.str()));
  if (t.empty() || t.find_first_of(" \t\r\n") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("token file '", path,
                                                   "' must hold one token (no spaces), got ",
                                                   t.empty() ? "nothing" : "several words"));
  }
  return t;
}

void ApplySecurityEnvironment(ClientOptions* o) {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  };
  if (std::string v = env("KVCD_TOKEN"); !v.empty()) o->token = v;
  if (std::string v = env("KVCD_TOKEN_FILE"); !v.empty() && o->token.empty()) {
    if (auto t = ReadTokenFile(v); t.ok()) o->token = *t;
  }
  if (std::string v = env("KVCD_TLS_CA"); !v.empty()) o->tls_root_ca_file = v;
  if (std::string v = env("KVCD_TLS_CERT"); !v.empty()) o->tls_client_cert_file = v;
  if (std::string v = env("KVCD_TLS_KEY"); !v.empty()) o->tls_client_key_file = v;
  if (std::string v = env("KVCD_TLS_SERVER_NAME"); !v.empty()) o->tls_server_name = v;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  std::unique_ptr<Client> c(new Client(options));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  auto creds = MakeCredentials(options);
  if (!creds.ok()) return creds.status();
  c->channel_ = grpc::CreateCustomChannel(options.target, *creds, args);
  if (!c->channel_->WaitForConnected(std::chrono::system_clock::now() + options.connect_timeout)) {
    return absl::UnavailableError(
        UnreachableMessage(options.target, options.UsesTls(), options.connect_timeout));
  }
  c->stub_ = v1::KvCache::NewStub(c->channel_);
  c->health_ = grpc::health::v1::Health::NewStub(c->channel_);
  return c;
}

void Client::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() + options_.deadline);
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
}

namespace {
template <class Resp, class Call>
absl::StatusOr<Resp> Unary(const Client* self, Call call) {
  Resp resp;
  grpc::Status s = call(&resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}
}  // namespace

#define KVCD_CALL(Resp, Method, req)       \
  Unary<Resp>(this, [&](Resp* resp) {      \
    grpc::ClientContext ctx;               \
    Prepare(&ctx);                         \
    return stub_->Method(&ctx, req, resp); \
  })

absl::StatusOr<v1::ModelInfo> Client::RegisterModel(const v1::ModelProfile& profile,
                                                    const std::string& codec_blob,
                                                    const std::string& tenant) {
  v1::RegisterModelRequest req;
  *req.mutable_profile() = profile;
  req.set_codec_blob(codec_blob);
  req.set_tenant(tenant);
  auto r = KVCD_CALL(v1::RegisterModelResponse, RegisterModel, req);
  if (!r.ok()) return r.status();
  return r->model();
}

absl::StatusOr<std::vector<v1::ModelInfo>> Client::ListModels() {
  auto r = KVCD_CALL(v1::ListModelsResponse, ListModels, v1::ListModelsRequest());
  if (!r.ok()) return r.status();
  return std::vector<v1::ModelInfo>(r->models().begin(), r->models().end());
}

absl::StatusOr<v1::ModelInfo> Client::GetModel(const std::string& name) {
  auto models = ListModels();
  if (!models.ok()) return models.status();
  for (const auto& m : *models) {
    if (m.profile().name() == name) return m;
  }
  return absl::NotFoundError(absl::StrCat("model '", name, "' is not registered"));
}

absl::StatusOr<v1::PutResponse> Client::Put(const v1::PutRequest& req) {
  return KVCD_CALL(v1::PutResponse, Put, req);
}

absl::StatusOr<v1::MatchResponse> Client::Match(const std::string& model, const std::string& salt,
                                                absl::Span<const int32_t> tokens) {
  v1::MatchRequest req;
  req.set_model(model);
  req.set_cache_salt(salt);
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  return KVCD_CALL(v1::MatchResponse, Match, req);
}

absl::StatusOr<v1::OpenSequenceResponse> Client::OpenSequence(const std::string& model,
                                                              const std::string& salt,
                                                              absl::Span<const int32_t> tokens,
                                                              int64_t lease_ms) {
  v1::OpenSequenceRequest req;
  req.set_model(model);
  req.set_cache_salt(salt);
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  req.set_lease_ms(lease_ms);
  return KVCD_CALL(v1::OpenSequenceResponse, OpenSequence, req);
}

absl::StatusOr<int64_t> Client::CloseSequence(uint64_t sequence_id) {
  v1::CloseSequenceRequest req;
  req.set_sequence_id(sequence_id);
  auto r = KVCD_CALL(v1::CloseSequenceResponse, CloseSequence, req);
  if (!r.ok()) return r.status();
  return r->length();
}

absl::StatusOr<v1::CloseSequenceResponse> Client::CloseSequence(uint64_t sequence_id, bool commit) {
  v1::CloseSequenceRequest req;
  req.set_sequence_id(sequence_id);
  req.set_commit(commit);
  return KVCD_CALL(v1::CloseSequenceResponse, CloseSequence, req);
}

absl::StatusOr<v1::CommitSequenceResponse> Client::CommitSequence(uint64_t sequence_id) {
  v1::CommitSequenceRequest req;
  req.set_sequence_id(sequence_id);
  return KVCD_CALL(v1::CommitSequenceResponse, CommitSequence, req);
}

absl::StatusOr<v1::ForkSequenceResponse> Client::ForkSequence(uint64_t sequence_id,
                                                              int64_t lease_ms) {
  v1::ForkSequenceRequest req;
  req.set_sequence_id(sequence_id);
  req.set_lease_ms(lease_ms);
  return KVCD_CALL(v1::ForkSequenceResponse, ForkSequence, req);
}

absl::StatusOr<int64_t> Client::RenewLease(uint64_t sequence_id, int64_t lease_ms) {
  v1::RenewLeaseRequest req;
  req.set_sequence_id(sequence_id);
  req.set_lease_ms(lease_ms);
  auto r = KVCD_CALL(v1::RenewLeaseResponse, RenewLease, req);
  if (!r.ok()) return r.status();
  return r->lease_ms();
}

absl::StatusOr<int64_t> Client::Append(const v1::AppendRequest& req) {
  auto r = KVCD_CALL(v1::AppendResponse, Append, req);
  if (!r.ok()) return r.status();
  return r->length();
}

absl::StatusOr<v1::AttentionDecodeResponse> Client::AttentionDecode(
    const v1::AttentionDecodeRequest& req) {
  return KVCD_CALL(v1::AttentionDecodeResponse, AttentionDecode, req);
}

absl::StatusOr<v1::FetchPagesResponse> Client::FetchPages(const v1::FetchPagesRequest& req) {
  return KVCD_CALL(v1::FetchPagesResponse, FetchPages, req);
}

absl::StatusOr<int64_t> Client::PushPages(const v1::PushPagesRequest& req) {
  auto r = KVCD_CALL(v1::PushPagesResponse, PushPages, req);
  if (!r.ok()) return r.status();
  return r->inserted_tokens();
}

absl::StatusOr<v1::PullPrefixResponse> Client::PullPrefix(const v1::PullPrefixRequest& req) {
  return KVCD_CALL(v1::PullPrefixResponse, PullPrefix, req);
}

absl::StatusOr<v1::StatsResponse> Client::Stats() {
  return KVCD_CALL(v1::StatsResponse, Stats, v1::StatsRequest());
}

absl::StatusOr<v1::PinPrefixResponse> Client::PinPrefix(const std::string& model,
                                                        const std::string& salt,
                                                        absl::Span<const int32_t> tokens,
                                                        int64_t ttl_ms) {
  v1::PinPrefixRequest req;
  req.set_model(model);
  req.set_cache_salt(salt);
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  req.set_ttl_ms(ttl_ms);
  return KVCD_CALL(v1::PinPrefixResponse, PinPrefix, req);
}

absl::StatusOr<int64_t> Client::UnpinPrefix(uint64_t pin_id) {
  v1::UnpinPrefixRequest req;
  req.set_pin_id(pin_id);
  auto r = KVCD_CALL(v1::UnpinPrefixResponse, UnpinPrefix, req);
  if (!r.ok()) return r.status();
  return r->unpinned_pages();
}

absl::StatusOr<v1::RegisterBufferResponse> Client::RegisterBuffer(
    const v1::RegisterBufferRequest& req) {
  return KVCD_CALL(v1::RegisterBufferResponse, RegisterBuffer, req);
}

absl::Status Client::UnregisterBuffer(uint64_t buffer_id) {
  v1::UnregisterBufferRequest req;
  req.set_buffer_id(buffer_id);
  return KVCD_CALL(v1::UnregisterBufferResponse, UnregisterBuffer, req).status();
}

absl::StatusOr<int64_t> Client::RenewBuffer(uint64_t buffer_id, int64_t lease_ms) {
  v1::RenewBufferRequest req;
  req.set_buffer_id(buffer_id);
  req.set_lease_ms(lease_ms);
  auto r = KVCD_CALL(v1::RenewBufferResponse, RenewBuffer, req);
  if (!r.ok()) return r.status();
  return r->lease_ms();
}

absl::StatusOr<v1::NcclConnectResponse> Client::NcclConnect(const std::string& name,
                                                            int64_t timeout_ms) {
  v1::NcclConnectRequest req;
  req.set_name(name);
  req.set_timeout_ms(timeout_ms);
  return KVCD_CALL(v1::NcclConnectResponse, NcclConnect, req);
}

absl::Status Client::NcclDisconnect(uint64_t communicator_id) {
  v1::NcclDisconnectRequest req;
  req.set_communicator_id(communicator_id);
  return KVCD_CALL(v1::NcclDisconnectResponse, NcclDisconnect, req).status();
}

absl::Status Client::OpenDecodeChannelRpc(const v1::OpenDecodeChannelRequest& req,
                                          v1::OpenDecodeChannelResponse* resp) {
  auto r = KVCD_CALL(v1::OpenDecodeChannelResponse, OpenDecodeChannel, req);
  if (!r.ok()) return r.status();
  *resp = *r;
  return absl::OkStatus();
}

absl::Status Client::CloseDecodeChannel(uint64_t channel_id) {
  v1::CloseDecodeChannelRequest req;
  req.set_channel_id(channel_id);
  return KVCD_CALL(v1::CloseDecodeChannelResponse, CloseDecodeChannel, req).status();
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Client::Health() {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = health_->Check(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp.status();
}
#undef KVCD_CALL

absl::StatusOr<std::unique_ptr<DecodeStream>> Client::OpenDecodeStream() {
  std::unique_ptr<DecodeStream> s(new DecodeStream());
  // A stream lives for a whole decode session: no overall deadline, but every Call
  // waits at most options_.deadline for its answer through the channel's keepalive.
  if (!options_.token.empty()) {
    s->ctx_.AddMetadata("authorization", "Bearer " + options_.token);
  }
  s->rw_ = stub_->AttentionDecodeStream(&s->ctx_);
  if (s->rw_ == nullptr) return absl::UnavailableError("cannot open AttentionDecodeStream");
  return s;
}

DecodeStream::~DecodeStream() {
  if (!closed_ && rw_ != nullptr) {
    ctx_.TryCancel();
    rw_->Finish().IgnoreError();
  }
}

absl::StatusOr<v1::AttentionDecodeResponse> DecodeStream::Call(
    const v1::AttentionDecodeRequest& req) {
  if (closed_) return absl::FailedPreconditionError("decode stream is closed");
  if (!rw_->Write(req)) {
    closed_ = true;
    return FromGrpcStatus(rw_->Finish());
  }
  v1::AttentionDecodeStreamResponse resp;
  if (!rw_->Read(&resp)) {
    closed_ = true;
    grpc::Status s = rw_->Finish();
    return s.ok() ? absl::UnavailableError("decode stream ended without an answer")
                  : FromGrpcStatus(s);
  }
  if (resp.error_code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(resp.error_code()), resp.error_message());
  }
  return std::move(*resp.mutable_response());
}

absl::Status DecodeStream::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  rw_->WritesDone();
  return FromGrpcStatus(rw_->Finish());
}

}  // namespace kvcd
