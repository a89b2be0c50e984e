// Authorizer: what an authenticated principal (auth.h) may do, checked for every call
// before it is routed to the engine, so a refused call changes nothing stored.
//
// Rules (none apply to the unrestricted principal of a daemon without auth):
// - Put, Match, OpenSequence, PushPages: the request's cache_salt must be one of the
//   token's tenants, else PERMISSION_DENIED.
// - Append, AttentionDecode (every id of the batch), FetchPages, RenewLease,
//   CloseSequence, CommitSequence, ForkSequence: the sequence must have been opened under one of
//   the token's tenants. Another tenant's sequence is answered exactly like a sequence that does
//   not exist (NOT_FOUND, same message), so ids cannot be probed across tenants.
// - RegisterModel needs register_models: true, else PERMISSION_DENIED; its `tenant` (the
//   tenant whose max_models / max_model_bytes quotas it counts against) must be one of the
//   token's tenants, as a cache_salt must.
// - RegisterBuffer/UnregisterBuffer/RenewBuffer, NcclConnect/NcclDisconnect,
//   OpenDecodeChannel/CloseDecodeChannel, and any TensorRef naming a cuda_ipc buffer or
//   an nccl communicator, need data_plane: true (else PERMISSION_DENIED). Buffers,
//   communicators and channels are bound to the token (by name) that created them;
//   another token's object is NOT_FOUND with the message of a missing one.
// - PinPrefix: its cache_salt must be one of the token's tenants (PERMISSION_DENIED, as
//   for Match). UnpinPrefix: the pin must have been made under one of the token's tenants;
//   another tenant's pin is answered exactly like a pin that is not live (NOT_FOUND, same
//   message).
// - ListModels and Stats: any valid token, scoped to it (Scope): a token of every tenant
//   ("*") sees the whole daemon; any other token sees its own tenants in Stats.tenants and
//   Stats.pins, and no daemon-wide activity (the counters of every tenant's calls, the
//   pools' used pages, cached tokens and open sequences are 0), only the daemon's
//   configuration: models, formats, pool sizes, budget, backend, version.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "kvcd/v1/kvcache.pb.h"
#include "server/cache/sequence.h"
#include "server/rpc/auth.h"

namespace kvcd {

class Authorizer {
 public:
  // An open sequence (its tenant is its salt), NOT_FOUND if it is not open
  // (CacheEngine::LookupSequence).
  using SequenceLookup = std::function<absl::StatusOr<std::shared_ptr<Sequence>>(uint64_t)>;
  // The tenant of a live prefix pin, NOT_FOUND if it is not live.
  using PinTenantLookup = std::function<absl::StatusOr<std::string>(uint64_t)>;
  explicit Authorizer(SequenceLookup lookup, PinTenantLookup pin_tenant = nullptr)
      : lookup_(std::move(lookup)), pin_tenant_(std::move(pin_tenant)) {}

  // The sequence-scoped checks (Close, Commit, Fork, Renew, Append, AttentionDecode,
  // FetchPages) add the
  // sequences they looked up to *found, in the request's order, for the engine to use
  // instead of looking them up again; nothing is added for the unrestricted principal,
  // whose calls look up nothing here.
  absl::Status Check(const Principal& p, const v1::RegisterModelRequest& r) const;
  absl::Status Check(const Principal& p, const v1::ListModelsRequest& r) const;
  absl::Status Check(const Principal& p, const v1::PutRequest& r) const;
  absl::Status Check(const Principal& p, const v1::MatchRequest& r) const;
  absl::Status Check(const Principal& p, const v1::OpenSequenceRequest& r) const;
  absl::Status Check(const Principal& p, const v1::CloseSequenceRequest& r,
                     FoundSequences* found = nullptr) const;
  absl::Status Check(const Principal& p, const v1::RenewLeaseRequest& r,
                     FoundSequences* found = nullptr) const;
  absl::Status Check(const Principal& p, const v1::CommitSequenceRequest& r,
                     FoundSequences* found = nullptr) const;
  absl::Status Check(const Principal& p, const v1::ForkSequenceRequest& r,
                     FoundSequences* found = nullptr) const;
  absl::Status Check(const Principal& p, const v1::AppendRequest& r,
                     FoundSequences* found = nullptr) const;
  absl::Status Check(const Principal& p, const v1::AttentionDecodeRequest& r,
                     FoundSequences* found = nullptr) const;
  absl::Status Check(const Principal& p, const v1::FetchPagesRequest& r,
                     FoundSequences* found = nullptr) const;
  absl::Status Check(const Principal& p, const v1::PushPagesRequest& r) const;
  absl::Status Check(const Principal& p, const v1::PullPrefixRequest& r) const;
  absl::Status Check(const Principal& p, const v1::StatsRequest& r) const;
  absl::Status Check(const Principal& p, const v1::PinPrefixRequest& r) const;
  absl::Status Check(const Principal& p, const v1::UnpinPrefixRequest& r) const;
  // What of an answer the principal may see (the rules above); the unrestricted principal
  // and "*" tokens see all of it.
  void Scope(const Principal& p, v1::StatsResponse* r) const;
  void Scope(const Principal& p, v1::ListModelsResponse* r) const;
  absl::Status Check(const Principal& p, const v1::RegisterBufferRequest& r) const;
  absl::Status Check(const Principal& p, const v1::UnregisterBufferRequest& r) const;
  absl::Status Check(const Principal& p, const v1::RenewBufferRequest& r) const;
  absl::Status Check(const Principal& p, const v1::NcclConnectRequest& r) const;
  absl::Status Check(const Principal& p, const v1::NcclDisconnectRequest& r) const;
  absl::Status Check(const Principal& p, const v1::OpenDecodeChannelRequest& r) const;
  absl::Status Check(const Principal& p, const v1::CloseDecodeChannelRequest& r) const;

  // Data-plane objects and the principal that created them.
  enum class Object { kBuffer, kCommunicator, kChannel };
  void Bind(Object kind, uint64_t id, const Principal& p);
  void Unbind(Object kind, uint64_t id);

 private:
  absl::Status CheckTenant(const Principal& p, const std::string& salt) const;
  absl::Status CheckSequence(const Principal& p, uint64_t id, FoundSequences* found) const;
  absl::Status CheckDataPlane(const Principal& p, const char* what) const;
  absl::Status CheckOwner(const Principal& p, Object kind, uint64_t id) const;
  // Every cuda_ipc buffer and nccl communicator the request's TensorRefs name.
  absl::Status CheckRefs(const Principal& p, const google::protobuf::Message& m) const;

  const SequenceLookup lookup_;
  const PinTenantLookup pin_tenant_;
  mutable std::mutex mu_;
  // -> principal name
  std::map<std::pair<Object, uint64_t>, std::string> owners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcd
