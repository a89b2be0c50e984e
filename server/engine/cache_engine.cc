#include "server/engine/cache_engine.h"

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/steady_clock.h"
#include "server/engine/request_checks.h"
#include "server/engine/tensor_checks.h"

namespace kvcd {

CacheEngine::CacheEngine(const ServerConfig& config, std::unique_ptr<Backend> backend)
    : config_(config),
      backend_(std::move(backend)),
      buffers_(backend_.get()),
      nccl_(backend_.get()),
      tensors_(backend_.get(), &buffers_),
      tenants_(config.quotas),
      sequences_(LeasePolicy{config.default_lease_ms, config.max_lease_ms}, config.max_sequences,
                 &tenants_),
      pins_(&tenants_, config.max_pin_ttl_ms) {}

CacheEngine::~CacheEngine() = default;

absl::Status CacheEngine::Put(const v1::PutRequest& req, v1::PutResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  KVCD_RETURN_IF_ERROR(CheckSalt(req.cache_salt()));
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", false));
  const int64_t n = req.tokens_size();
  const int64_t first = req.kv_first_token();
  if (first < 0 || first > n || first % m->spec().page_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_first_token is ", first, ", expected a multiple of page_size (",
                     m->spec().page_size, ") in 0..", n, " (the number of tokens)"));
  }
  const ModelSpec& s = m->spec();
  KVCD_ASSIGN_OR_RETURN(KvRows kv,
                        Rows(req.k(), req.v(), {"k", "v", true},
                             {s.num_layers, n - first, s.num_kv_heads, s.head_dim}, n - first, s));
  KVCD_ASSIGN_OR_RETURN(RowSource x,
                        Residuals(req.x(), req.has_x(), "x", s.num_layers, n - first, s));
  KVCD_ASSIGN_OR_RETURN(PutResult r, m->Put(req.cache_salt(), req.tokens(), first, kv.k, kv.v,
                                            x.data != nullptr ? &x : nullptr));
  resp->set_cached_tokens(r.cached_tokens);
  resp->set_inserted_tokens(r.inserted_tokens);
  resp->set_ignored_tokens(r.ignored_tokens);
  return absl::OkStatus();
}

absl::Status CacheEngine::Match(const v1::MatchRequest& req, v1::MatchResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  KVCD_RETURN_IF_ERROR(CheckSalt(req.cache_salt()));
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", true));
  int64_t committed = 0;
  const int64_t matched = m->Match(req.cache_salt(), req.tokens(), &committed);
  resp->set_matched_tokens(matched);
  resp->set_committed_tokens(committed);
  resp->set_matched_pages(matched / m->spec().page_size);
  return absl::OkStatus();
}

absl::Status CacheEngine::OpenSequence(const v1::OpenSequenceRequest& req,
                                       v1::OpenSequenceResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  KVCD_RETURN_IF_ERROR(CheckSalt(req.cache_salt()));
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", true));
  KVCD_ASSIGN_OR_RETURN(int64_t lease, sequences_.GrantLease(req.cache_salt(), req.lease_ms()));
  KVCD_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq,
                        sequences_.Open(m, req.cache_salt(), req.tokens(), lease));
  resp->set_sequence_id(seq->id);
  resp->set_matched_tokens(m->Length(seq.get()));
  resp->set_lease_ms(lease);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Sequence>> CacheEngine::LookupSequence(uint64_t id) const {
  return sequences_.Peek(id);
}

namespace {

void FillCommit(const ModelCache::CommitResult& r, v1::CommitSequenceResponse* resp) {
  resp->set_committed_tokens(r.committed_tokens);
  resp->set_inserted_pages(r.inserted_pages);
  resp->set_deduplicated_pages(r.deduplicated_pages);
}

}  // namespace

absl::Status CacheEngine::CloseSequence(const v1::CloseSequenceRequest& req,
                                        v1::CloseSequenceResponse* resp,
                                        const FoundSequences& found) {
  if (!req.commit()) {
    KVCD_ASSIGN_OR_RETURN(int64_t length, sequences_.Close(req.sequence_id()));
    resp->set_length(length);
    return absl::OkStatus();
  }
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Use(req.sequence_id(), found, 0));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
  // Commit and close in one step of the sequence; then the table lets it go (a lease that
  // ran out meanwhile has let it go already: the commit happened all the same).
  KVCD_ASSIGN_OR_RETURN(ModelCache::CommitResult r, seq->model->Commit(seq.get(), /*close=*/true));
  (void)sequences_.Close(req.sequence_id());
  resp->set_length(r.length);
  FillCommit(r, resp->mutable_commit());
  return absl::OkStatus();
}

absl::Status CacheEngine::CommitSequence(const v1::CommitSequenceRequest& req,
                                         v1::CommitSequenceResponse* resp,
                                         const FoundSequences& found) {
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Use(req.sequence_id(), found, 0));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
  KVCD_ASSIGN_OR_RETURN(ModelCache::CommitResult r, seq->model->Commit(seq.get()));
  FillCommit(r, resp);
  return absl::OkStatus();
}

absl::Status CacheEngine::ForkSequence(const v1::ForkSequenceRequest& req,
                                       v1::ForkSequenceResponse* resp,
                                       const FoundSequences& found) {
  KVCD_ASSIGN_OR_RETURN(auto src, sequences_.Use(req.sequence_id(), found, 0));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*src));
  KVCD_ASSIGN_OR_RETURN(int64_t lease, sequences_.GrantLease(src->salt, req.lease_ms()));
  KVCD_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> fork, sequences_.Fork(*src, lease));
  const int64_t len = fork->model->Length(fork.get());
  resp->set_sequence_id(fork->id);
  resp->set_length(len);
  resp->set_lease_ms(lease);
  resp->set_shared_pages(len / fork->model->spec().page_size);
  return absl::OkStatus();
}

absl::Status CacheEngine::RenewLease(const v1::RenewLeaseRequest& req, v1::RenewLeaseResponse* resp,
                                     const FoundSequences& found) {
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Use(req.sequence_id(), found, 0));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
  KVCD_ASSIGN_OR_RETURN(int64_t lease, sequences_.Renew(*seq, req.lease_ms()));
  resp->set_lease_ms(lease);
  return absl::OkStatus();
}

absl::Status CacheEngine::Append(const v1::AppendRequest& req, v1::AppendResponse* resp,
                                 const FoundSequences& found) {
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Use(req.sequence_id(), found, 0));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
  const ModelSpec& s = seq->model->spec();
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", false));
  const int64_t n = req.tokens_size();
  KVCD_ASSIGN_OR_RETURN(KvRows kv, Rows(req.k(), req.v(), {"k", "v", true},
                                        {s.num_layers, n, s.num_kv_heads, s.head_dim}, n, s));
  KVCD_ASSIGN_OR_RETURN(RowSource x, Residuals(req.x(), req.has_x(), "x", s.num_layers, n, s));
  // The tenant's max_pinned_pages quota covers the pages this append adds.
  KVCD_RETURN_IF_ERROR(sequences_.ReserveTokens(*seq, n));
  absl::StatusOr<int64_t> len =
      seq->model->Append(seq.get(), req.tokens(), kv.k, kv.v, x.data != nullptr ? &x : nullptr);
  sequences_.Settle(*seq);
  if (!len.ok()) return len.status();
  resp->set_length(*len);
  return absl::OkStatus();
}

absl::Status CacheEngine::RegisterBuffer(const v1::RegisterBufferRequest& req,
                                         v1::RegisterBufferResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(int64_t lease, sequences_.leases().Grant(req.lease_ms()));
  std::string done;
  KVCD_ASSIGN_OR_RETURN(auto buf, buffers_.Register(req, lease, config_.max_buffers, &done));
  resp->set_buffer_id(buf->id);
  resp->set_done_event_handle(done);
  resp->set_lease_ms(lease);
  return absl::OkStatus();
}

absl::Status CacheEngine::UnregisterBuffer(const v1::UnregisterBufferRequest& req,
                                           v1::UnregisterBufferResponse*) {
  return buffers_.Unregister(req.buffer_id());
}

absl::Status CacheEngine::RenewBuffer(const v1::RenewBufferRequest& req,
                                      v1::RenewBufferResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(auto buf, buffers_.Find(req.buffer_id()));
  if (req.lease_ms() != 0) {
    KVCD_ASSIGN_OR_RETURN(int64_t lease, sequences_.leases().Grant(req.lease_ms()));
    buf->lease_ms.store(lease);
  }
  buf->deadline_ns.store(SteadyNowNs() + buf->lease_ms.load() * 1000000);
  resp->set_lease_ms(buf->lease_ms.load());
  return absl::OkStatus();
}

absl::Status CacheEngine::NcclConnect(const v1::NcclConnectRequest& req,
                                      v1::NcclConnectResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(NcclLinks::Connection c, nccl_.Connect(req.name(), req.timeout_ms()));
  resp->set_communicator_id(c.id);
  resp->set_unique_id(c.unique_id);
  return absl::OkStatus();
}

absl::Status CacheEngine::NcclDisconnect(const v1::NcclDisconnectRequest& req,
                                         v1::NcclDisconnectResponse*) {
  return nccl_.Disconnect(req.communicator_id());
}

absl::Status CacheEngine::PinPrefix(const v1::PinPrefixRequest& req, v1::PinPrefixResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  KVCD_RETURN_IF_ERROR(CheckSalt(req.cache_salt()));
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", false));
  const int64_t now_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count();
  KVCD_ASSIGN_OR_RETURN(PrefixPins::Pin pin, pins_.Add(m, req.cache_salt(), req.tokens(),
                                                       req.ttl_ms(), SteadyNowNs(), now_unix_ms));
  resp->set_pin_id(pin.id);
  resp->set_pinned_tokens(pin.tokens);
  resp->set_pinned_pages(pin.pages);
  resp->set_expires_unix_ms(pin.expires_unix_ms);
  return absl::OkStatus();
}

absl::Status CacheEngine::UnpinPrefix(const v1::UnpinPrefixRequest& req,
                                      v1::UnpinPrefixResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(int64_t pages, pins_.Remove(req.pin_id()));
  resp->set_unpinned_pages(pages);
  return absl::OkStatus();
}

}  // namespace kvcd
