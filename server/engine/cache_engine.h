// CacheEngine: the daemon's request-level core, independent of gRPC. It validates
// every request (shapes, dtypes, lengths, ids; int64 overflow-safe, before anything
// is allocated) and routes it: to the model's ModelCache, to the SequenceTable (which owns
// sequences and leases; TenantLedger holds what tenants hold), and to the data plane
// (TensorResolver for where a tensor's bytes are, BufferRegistry, NcclLinks). Errors are
// absl::Status with the codes of docs/api.md "Errors"; the service maps them to gRPC
// once (rpc/status_mapping.h).
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "kvcd/v1/kvcache.pb.h"
#include "server/backends/backend.h"
#include "server/cache/model_cache.h"
#include "server/config/config.h"
#include "server/dataplane/buffer_registry.h"
#include "server/dataplane/decode_engine.h"
#include "server/dataplane/nccl_links.h"
#include "server/dataplane/tensor_resolver.h"
#include "server/engine/prefix_pins.h"
#include "server/engine/sequence_table.h"
#include "server/engine/tenant_ledger.h"

namespace kvcd {

class CacheEngine : public DecodeEngine {
 public:
  CacheEngine(const ServerConfig& config, std::unique_ptr<Backend> backend);
  ~CacheEngine();

  // Registers a model; ALREADY_EXISTS if the name is taken by a different profile,
  // RESOURCE_EXHAUSTED if the budget cannot hold memory_bytes more. With `tenant` (a
  // RegisterModel call) the registration counts against that tenant's max_models and
  // max_model_bytes (RESOURCE_EXHAUSTED naming the quota, nothing allocated); without
  // (the config's models) it counts against no tenant. Registering a model already
  // registered with the same profile is OK and counts nothing. The codec file is parsed
  // without the engine's lock (other calls go on meanwhile) and its transient memory is
  // given back to the system afterwards.
  absl::Status RegisterModelSpec(const ModelSpec& spec, const std::string& codec_blob = "",
                                 const std::string* tenant = nullptr);

  absl::Status RegisterModel(const v1::RegisterModelRequest& req, v1::RegisterModelResponse* resp);
  absl::Status ListModels(const v1::ListModelsRequest& req, v1::ListModelsResponse* resp);
  absl::Status Put(const v1::PutRequest& req, v1::PutResponse* resp);
  absl::Status Match(const v1::MatchRequest& req, v1::MatchResponse* resp);
  absl::Status OpenSequence(const v1::OpenSequenceRequest& req, v1::OpenSequenceResponse* resp);
  // The sequence-scoped calls take the sequences the authorizer found for them (in the
  // request's order; FoundSequences), so that they are not looked up twice; without, the
  // engine finds them itself.
  // With `commit`, the sequence's full pages enter the prefix cache first (CommitSequence);
  // a commit that fails leaves the sequence open and unchanged.
  absl::Status CloseSequence(const v1::CloseSequenceRequest& req, v1::CloseSequenceResponse* resp,
                             const FoundSequences& found = {});
  // Sessions (docs/sessions.md): ModelCache::Commit and SequenceTable::Fork.
  absl::Status CommitSequence(const v1::CommitSequenceRequest& req,
                              v1::CommitSequenceResponse* resp, const FoundSequences& found = {});
  absl::Status ForkSequence(const v1::ForkSequenceRequest& req, v1::ForkSequenceResponse* resp,
                            const FoundSequences& found = {});
  absl::Status RenewLease(const v1::RenewLeaseRequest& req, v1::RenewLeaseResponse* resp,
                          const FoundSequences& found = {});
  absl::Status Append(const v1::AppendRequest& req, v1::AppendResponse* resp,
                      const FoundSequences& found = {});
  // Defined in attention_decode.cc, step by step. Also what decode channels hand their
  // requests to (DecodeEngine).
  absl::Status AttentionDecode(const v1::AttentionDecodeRequest& req,
                               v1::AttentionDecodeResponse* resp,
                               const FoundSequences& found = {}) override;
  absl::Status AttentionDecodeSignaled(const v1::AttentionDecodeRequest& req,
                                       v1::AttentionDecodeResponse* resp,
                                       const FoundSequences& found,
                                       const DeviceSignal& signal) override;
  absl::Status FetchPages(const v1::FetchPagesRequest& req, v1::FetchPagesResponse* resp,
                          const FoundSequences& found = {});
  absl::Status PushPages(const v1::PushPagesRequest& req, v1::PushPagesResponse* resp);
  // PushPages of pages already in this daemon's device memory (a peer's pages that
  // PullPrefix received over CUDA IPC or NCCL into its own staging): `req` names the model,
  // salt, tokens, first_page and num_pages (no `pages`, no inline_pages). StoredPagesBytes
  // is the bytes those pages take as this model stores them (what the staging must hold);
  // PushPagesFromDevice checks the request as PushPages does, that `bytes` equals it, and
  // stores with the same device checks (format, finite values): all or nothing.
  absl::StatusOr<int64_t> StoredPagesBytes(const v1::PushPagesRequest& req);
  absl::Status PushPagesFromDevice(const v1::PushPagesRequest& req, const uint8_t* device_pages,
                                   int64_t bytes, v1::PushPagesResponse* resp);
  // Prefix pins (prefix_pins.h). Stats lists every live pin; the RPC layer keeps only the
  // caller's tenants' (server/rpc/service.cc).
  absl::Status PinPrefix(const v1::PinPrefixRequest& req, v1::PinPrefixResponse* resp);
  absl::Status UnpinPrefix(const v1::UnpinPrefixRequest& req, v1::UnpinPrefixResponse* resp);
  absl::Status Stats(const v1::StatsRequest& req, v1::StatsResponse* resp);

  // Cluster (docs/cluster.md): the member id and incarnation Stats reports (fields 21-22),
  // set once by the daemon before it serves.
  void SetClusterIdentity(std::string member_id, std::string incarnation) {
    member_id_ = std::move(member_id);
    incarnation_ = std::move(incarnation);
  }
  // The load figures of Stats (fields 23-25) and of the index's load: hash.
  struct LoadFigures {
    uint64_t pages_used = 0;      // over all models' pools
    uint64_t pages_capacity = 0;  // pages the pools can hold
    uint64_t max_page_bytes = 0;  // the largest page of any pool
    uint64_t open_sequences = 0;
    uint64_t queued_decode = 0;  // AttentionDecode calls accepted and not yet answered
  };
  LoadFigures Load() const;
  // Every full page entering or leaving any model's tree goes to `observer` (the cluster's
  // block index and events; server/cache/block_observer.h). REQUIRES: called before any
  // model is registered; the observer outlives the engine's models.
  void SetBlockObserver(BlockObserver* observer) { block_observer_ = observer; }
  // Tells `to` of every page held (a republish to one observer).
  void ReplayBlocks(BlockObserver* to);
  absl::Status RegisterBuffer(const v1::RegisterBufferRequest& req,
                              v1::RegisterBufferResponse* resp);
  absl::Status UnregisterBuffer(const v1::UnregisterBufferRequest& req,
                                v1::UnregisterBufferResponse* resp);
  absl::Status RenewBuffer(const v1::RenewBufferRequest& req, v1::RenewBufferResponse* resp);
  absl::Status NcclConnect(const v1::NcclConnectRequest& req, v1::NcclConnectResponse* resp);
  absl::Status NcclDisconnect(const v1::NcclDisconnectRequest& req,
                              v1::NcclDisconnectResponse* resp);
  // An open sequence (its tenant is its salt) without touching its lease; NOT_FOUND with
  // the same message as every other call on an unknown sequence. The RPC layer authorizes
  // sequence-scoped calls with it and hands what it found on (server/rpc/authorizer.h).
  absl::StatusOr<std::shared_ptr<Sequence>> LookupSequence(uint64_t id) const;
  int64_t RegisteredBuffers() const { return buffers_.size(); }
  int64_t NcclCommunicators() const { return nccl_.size(); }

  // Closes every sequence and drops every registered buffer whose lease ran out before
  // now_ns (steady clock); returns how many. Called periodically by the daemon.
  int ExpireLeases(int64_t now_ns);
  // Removes the prefix pins whose ttl ran out before now_ns (steady clock); how many.
  // Called periodically by the daemon, beside ExpireLeases.
  int ExpirePins(int64_t now_ns);
  // A live prefix pin (the authorizer's look-up of its tenant); NOT_FOUND otherwise.
  absl::StatusOr<PrefixPins::Pin> LookupPin(uint64_t pin_id) const { return pins_.Lookup(pin_id); }
  std::vector<PrefixPins::Pin> Pins() const { return pins_.List(); }
  uint64_t ExpiredPins() const { return pins_.expired(); }

  const CacheCounters& counters() const { return counters_; }
  const LeasePolicy& leases() const { return sequences_.leases(); }
  // What each tenant holds (decode channels are charged here by the RPC layer).
  TenantLedger& ledger() { return tenants_; }
  const ServerConfig& config() const { return config_; }
  const char* backend_name() const { return backend_->name(); }
  bool backend_healthy() const { return backend_->Healthy(); }

  struct ModelView {
    std::string name;
    ModelSnapshot snapshot;
  };
  std::vector<ModelView> SnapshotModels() const;
  int64_t ActiveSequences() const;
  // Every tenant with open sequences, pages, registered models or a configured quota.
  std::vector<TenantUsage> TenantUsages() const;
  uint64_t MemoryUsedBytes() const;  // sum of the models' pool bytes

 private:
  absl::StatusOr<ModelCache*> FindModel(const std::string& name) const;
  void FillModelInfo(const ModelCache& m, v1::ModelInfo* info) const;
  // Rows and Residuals are defined in request_rows.cc.
  // K and V rows of a request ([layers, n, kv_heads, head_dim], or [B, kv_heads, head_dim]
  // for one layer) where their bytes are (host, or device for cuda_ipc), resolved together
  // by the data plane (TensorResolver::ResolveAll).
  struct KvRows {
    RowSource k, v;
  };
  struct KvNames {
    absl::string_view k, v;
    bool same_dtype;  // V must have K's dtype (Put, Append)
  };
  absl::StatusOr<KvRows> Rows(const v1::TensorRef& k, const v1::TensorRef& v, KvNames names,
                              std::vector<int64_t> shape, int64_t n, const ModelSpec& s);
  // The residuals `field` of n tokens (`layers` = num_layers: [layers, n, C]; 0: one layer,
  // [n, C]) of an FSQ model, checked (present exactly for FSQ models, dtype, shape) where
  // its bytes are: inline ones in host memory, scanned for NaN/Inf here; cuda_ipc ones in
  // device memory, checked by the format's encoder as it reads them (check_finite). A
  // RowSource with data == nullptr for other models. INVALID_ARGUMENT naming the field.
  absl::StatusOr<RowSource> Residuals(const v1::TensorRef& t, bool present, absl::string_view field,
                                      int64_t layers, int64_t n, const ModelSpec& s);
  absl::Status PushDevicePages(ModelCache& m, const v1::PushPagesRequest& req,
                               v1::PushPagesResponse* resp);
  // The bytes of req's num_pages pages from first_page as m stores them, after checking
  // the counts against the tokens.
  static absl::StatusOr<int64_t> PushedPagesBytes(const ModelCache& m,
                                                  const v1::PushPagesRequest& req);

  // The steps of AttentionDecode (attention_decode.cc).
  struct DecodeQueries {
    bool on_device = false;  // else in `host` as floats
    bool bf16 = false;       // the request's dtype
    BufferRegistry::Region region;
    std::vector<float> host;
  };
  struct DecodeOutputs {
    bool on_device = false;  // o_out / lse_out given; else inline in the response
    BufferRegistry::Region o, lse;
  };
  // The batch's sequences: 1..kMaxBatch distinct open ids of one model, none faulted.
  absl::StatusOr<FoundSequences> DecodeBatch(const v1::AttentionDecodeRequest& req,
                                             const FoundSequences& found);
  absl::StatusOr<DecodeQueries> ResolveQueries(const v1::AttentionDecodeRequest& req,
                                               const FoundSequences& seqs, const ModelSpec& s);
  absl::StatusOr<DecodeOutputs> ResolveOutputs(const v1::AttentionDecodeRequest& req, int64_t batch,
                                               const ModelSpec& s);
  // k_new / v_new / x_new / new_tokens of a fused append (all absent otherwise).
  absl::Status ResolveNewTokens(const v1::AttentionDecodeRequest& req, int64_t batch,
                                const ModelSpec& s, ModelCache::NewTokens* out, RowSource* x_new);
  // Points the kernels at the queries and results (device), or sizes the inline results.
  absl::Status BindDecodeIo(const v1::AttentionDecodeRequest& req, const ModelSpec& s,
                            int64_t batch, const DecodeQueries& q, const DecodeOutputs& out,
                            ModelCache::DeviceIo* device, v1::AttentionDecodeResponse* resp);

  // RegisterModelSpec's checks before anything is parsed or allocated: ALREADY_EXISTS,
  // the budget, the tenant's registration quotas (*limit, *limit_what: what Create may
  // allocate); *registered when the same profile is registered already.
  absl::Status CheckRegistrationLocked(const ModelSpec& spec, const std::string* tenant,
                                       bool* registered, uint64_t* limit,
                                       std::string* limit_what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A codec blob this large leaves enough freed heap behind its parse to trim.
  static constexpr size_t kTrimAfterCodecBytes = 1 << 20;

  const ServerConfig config_;
  std::unique_ptr<Backend> backend_;
  BufferRegistry buffers_;  // destroyed before backend_
  NcclLinks nccl_;
  TensorResolver tensors_;
  CacheCounters counters_;
  std::atomic<uint64_t> decode_in_flight_{0};
  std::string member_id_, incarnation_;      // SetClusterIdentity
  BlockObserver* block_observer_ = nullptr;  // SetBlockObserver

  TenantLedger tenants_;  // what each tenant holds and may hold

  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<ModelCache>> models_ ABSL_GUARDED_BY(mu_);
  uint64_t budget_used_ ABSL_GUARDED_BY(mu_) = 0;
  SequenceTable sequences_;  // destroyed (closing sequences) before models_
  PrefixPins pins_;          // destroyed (unpinning) before models_ and tenants_
};

}  // namespace kvcd
