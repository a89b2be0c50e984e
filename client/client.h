// kvcd::Client: the C++ client library of the kvcd daemon.
//
// Every call has a deadline (ClientOptions::deadline unless given) and returns
// absl::Status / absl::StatusOr with the daemon's gRPC code and message carried over
// unchanged (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, FAILED_PRECONDITION,
// UNAVAILABLE, DEADLINE_EXCEEDED, ...).
//
// Thread safety: a Client may be shared by threads; a DecodeStream may not.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvcd/v1/kvcache.grpc.pb.h"

namespace kvcd {

struct ClientOptions {
  std::string target = "127.0.0.1:50051";     // host:port of the daemon
  std::chrono::milliseconds deadline{30000};  // per call
  std::chrono::milliseconds connect_timeout{10000};
  int64_t max_message_bytes = 256ll << 20;

  // Security (README.md "Security"). TLS is used when `tls` is true or any tls_* file
  // is set; without tls_root_ca_file the system's root certificates are trusted.
  bool tls = false;
  std::string tls_root_ca_file;      // PEM CA bundle that signed the daemon's certificate
  std::string tls_client_cert_file;  // mutual TLS: PEM certificate chain of this client
  std::string tls_client_key_file;   // mutual TLS: its PEM private key
  std::string tls_server_name;       // name to verify instead of the target's host
  // Bearer token, sent with every call as `authorization: Bearer <token>`.
  std::string token;

  bool UsesTls() const {
    return tls || !tls_root_ca_file.empty() || !tls_client_cert_file.empty() ||
           !tls_client_key_file.empty();
  }
};

// Fills the security fields from the environment where set: KVCD_TOKEN (or
// KVCD_TOKEN_FILE, a file holding the token), KVCD_TLS_CA, KVCD_TLS_CERT, KVCD_TLS_KEY,
// KVCD_TLS_SERVER_NAME. Command-line flags of the tools override these.
void ApplySecurityEnvironment(ClientOptions* options);
// Reads a token file (surrounding whitespace is dropped); NOT_FOUND / INVALID_ARGUMENT
// name the file.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// One bidirectional AttentionDecodeStream: the per-layer decode loop of a worker.
class DecodeStream {
 public:
  ~DecodeStream();
  // Sends one request and waits for its answer (the stream answers in order). A
  // per-request error comes back as that status; the stream stays usable.
  absl::StatusOr<v1::AttentionDecodeResponse> Call(const v1::AttentionDecodeRequest& req);
  // Half-closes and returns the stream's final status.
  absl::Status Close();

 private:
  friend class Client;
  DecodeStream() = default;
  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::AttentionDecodeRequest, v1::AttentionDecodeStreamResponse>>
      rw_;
  bool closed_ = false;
};

class Client {
 public:
  // Connects and waits up to connect_timeout for the channel to be ready
  // (UNAVAILABLE otherwise).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // `tenant`: the tenant the registration counts against (RegisterModelRequest.tenant).
  absl::StatusOr<v1::ModelInfo> RegisterModel(const v1::ModelProfile& profile,
                                              const std::string& codec_blob = "",
                                              const std::string& tenant = "");
  absl::StatusOr<std::vector<v1::ModelInfo>> ListModels();
  // The registered model `name` (NOT_FOUND if absent).
  absl::StatusOr<v1::ModelInfo> GetModel(const std::string& name);

  absl::StatusOr<v1::PutResponse> Put(const v1::PutRequest& req);
  absl::StatusOr<v1::MatchResponse> Match(const std::string& model, const std::string& salt,
                                          absl::Span<const int32_t> tokens);
  absl::StatusOr<v1::OpenSequenceResponse> OpenSequence(const std::string& model,
                                                        const std::string& salt,
                                                        absl::Span<const int32_t> tokens,
                                                        int64_t lease_ms = 0);
  // Returns the sequence's final length.
  absl::StatusOr<int64_t> CloseSequence(uint64_t sequence_id);
  // With `commit`, the sequence's full pages enter the prefix cache before it closes
  // (response.commit says what was committed); a failed commit leaves it open.
  absl::StatusOr<v1::CloseSequenceResponse> CloseSequence(uint64_t sequence_id, bool commit);
  // Sessions (docs/sessions.md): commit the full pages and keep the sequence open; fork a
  // new sequence sharing its pages (lease_ms 0: the daemon's default).
  absl::StatusOr<v1::CommitSequenceResponse> CommitSequence(uint64_t sequence_id);
  absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(uint64_t sequence_id, int64_t lease_ms = 0);
  // Returns the granted lease in ms.
  absl::StatusOr<int64_t> RenewLease(uint64_t sequence_id, int64_t lease_ms = 0);
  // Returns the new length.
  absl::StatusOr<int64_t> Append(const v1::AppendRequest& req);
  absl::StatusOr<v1::AttentionDecodeResponse> AttentionDecode(
      const v1::AttentionDecodeRequest& req);
  absl::StatusOr<v1::FetchPagesResponse> FetchPages(const v1::FetchPagesRequest& req);
  // Stores pages as another daemon's FetchPages returned them (inline bytes; INT2 stays
  // INT2). Returns the number of tokens newly inserted into the radix tree.
  absl::StatusOr<int64_t> PushPages(const v1::PushPagesRequest& req);
  absl::StatusOr<v1::StatsResponse> Stats();
  // Cluster (docs/cluster.md "Pulling pages from a peer"): this daemon pulls from member
  // req.peer_member_id the pages of the longest prefix of req.tokens that the peer holds
  // beyond its own.
  absl::StatusOr<v1::PullPrefixResponse> PullPrefix(const v1::PullPrefixRequest& req);

  // Pins the longest cached page-aligned prefix of `tokens` for ttl_ms (docs/sessions.md
  // "Pinned prefixes"): eviction skips it until UnpinPrefix or the ttl runs out.
  absl::StatusOr<v1::PinPrefixResponse> PinPrefix(const std::string& model, const std::string& salt,
                                                  absl::Span<const int32_t> tokens, int64_t ttl_ms);
  // Removes a pin; returns the pages it pinned.
  absl::StatusOr<int64_t> UnpinPrefix(uint64_t pin_id);

  // Data plane (daemon with backend: cuda). RegisterBuffer maps a device allocation of
  // this process into the daemon (see client/workers/ipc_buffer.h for the CUDA side).
  absl::StatusOr<v1::RegisterBufferResponse> RegisterBuffer(const v1::RegisterBufferRequest& req);
  absl::Status UnregisterBuffer(uint64_t buffer_id);
  absl::StatusOr<int64_t> RenewBuffer(uint64_t buffer_id, int64_t lease_ms = 0);
  absl::StatusOr<v1::NcclConnectResponse> NcclConnect(const std::string& name,
                                                      int64_t timeout_ms = 0);
  absl::Status NcclDisconnect(uint64_t communicator_id);
  // The RPCs behind DecodeChannel (client/decode_channel.h), which is what callers use.
  absl::Status OpenDecodeChannelRpc(const v1::OpenDecodeChannelRequest& req,
                                    v1::OpenDecodeChannelResponse* resp);
  absl::Status CloseDecodeChannel(uint64_t channel_id);
  // grpc.health.v1 Check of the whole server ("" service): SERVING, NOT_SERVING, ...
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health();

  absl::StatusOr<std::unique_ptr<DecodeStream>> OpenDecodeStream();

  const ClientOptions& options() const { return options_; }

 private:
  explicit Client(const ClientOptions& o) : options_(o) {}
  void Prepare(grpc::ClientContext* ctx) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// grpc::Status -> absl::Status (same code and message).
absl::Status FromGrpcStatus(const grpc::Status& s);

}  // namespace kvcd
