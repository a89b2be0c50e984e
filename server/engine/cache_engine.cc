#include "server/engine/cache_engine.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/phase_times.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "common/steady_clock.h"
#include "kvcd/kernels/bf16.h"
#include "proto/tensor_ref.h"
#include "server/backends/device_runtime.h"
#include "server/engine/request_checks.h"
#include "server/engine/tensor_checks.h"
#include "server/formats/format_registry.h"

namespace kvcd {
ModelSpec SpecFromProfile(const v1::ModelProfile& p) {
  ModelSpec s;
  s.name = p.name();
  s.num_layers = p.num_layers();
  s.num_q_heads = p.num_q_heads();
  s.num_kv_heads = p.num_kv_heads();
  s.head_dim = p.head_dim();
  s.page_size = p.page_size();
  s.sink_tokens = p.sink_tokens();
  s.recent_tokens = p.recent_tokens();
  // The format registry's (an unknown value was refused before: HistoryFormatOfProto).
  s.history_format = HistoryFormatOfProto(p.history_format()).value_or(FormatId::kBf16);
  s.rope_theta = p.rope().theta() == 0 ? 10000.0 : p.rope().theta();
  s.rope_rotary_dims = p.rope().rotary_dims();
  s.rope_scaling = p.rope().scaling() == 0 ? 1.0 : p.rope().scaling();
  s.rope_interleaved = p.rope().pairing() == v1::ROPE_PAIRING_INTERLEAVED;
  s.key_norm = p.key_norm() == v1::KEY_NORM_RMS;
  s.key_norm_eps = p.key_norm_eps() == 0 ? 1e-6f : p.key_norm_eps();
  s.fsq_residual_width = p.fsq_residual_width();
  s.fsq_latent_width = p.fsq_latent_width();
  s.memory_bytes = p.memory_bytes();
  s.bf16_fraction = p.bf16_fraction() == 0 ? 0.25 : p.bf16_fraction();
  s.codec = p.codec();
  return s;
}

void ProfileFromSpec(const ModelSpec& s, v1::ModelProfile* p) {
  p->set_name(s.name);
  p->set_num_layers(s.num_layers);
  p->set_num_q_heads(s.num_q_heads);
  p->set_num_kv_heads(s.num_kv_heads);
  p->set_head_dim(s.head_dim);
  p->set_page_size(s.page_size);
  p->set_sink_tokens(s.sink_tokens);
  p->set_recent_tokens(s.recent_tokens);
  p->set_history_format(static_cast<v1::HistoryFormat>(ProtoOfHistoryFormat(s.history_format)));
  p->mutable_rope()->set_theta(s.rope_theta);
  p->mutable_rope()->set_rotary_dims(s.rope_rotary_dims);
  p->mutable_rope()->set_scaling(s.rope_scaling);
  p->mutable_rope()->set_pairing(s.rope_interleaved ? v1::ROPE_PAIRING_INTERLEAVED
                                                    : v1::ROPE_PAIRING_HALF);
  p->set_key_norm(s.key_norm ? v1::KEY_NORM_RMS : v1::KEY_NORM_NONE);
  p->set_key_norm_eps(s.key_norm_eps);
  p->set_fsq_residual_width(s.fsq_residual_width);
  p->set_fsq_latent_width(s.fsq_latent_width);
  p->set_memory_bytes(s.memory_bytes);
  p->set_bf16_fraction(s.bf16_fraction);
  p->set_codec(s.codec);
}

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

absl::Status CacheEngine::RegisterModelSpec(const ModelSpec& spec, const std::string& codec_blob,
                                            const std::string* tenant) {
  KVCD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  uint64_t limit = 0;
  std::string limit_what;
  {  // Everything that refuses the registration before its codec is parsed, as before.
    std::lock_guard<std::mutex> lock(mu_);
    bool registered = false;
    KVCD_RETURN_IF_ERROR(CheckRegistrationLocked(spec, tenant, &registered, &limit, &limit_what));
    if (registered) return absl::OkStatus();  // idempotent
  }
  // The codec file (RegisterModel's codec_blob, or the spec's codec_file) is parsed without
  // the engine's lock, which every other call needs: a large one takes a while. Its
  // transient allocations (the header's JSON tree, the copies of the file) are given back
  // to the system once it is parsed.
  absl::StatusOr<std::unique_ptr<const ModelCodec>> codec = LoadModelCodec(spec, codec_blob);
#if defined(__GLIBC__)
  if (codec_blob.size() >= kTrimAfterCodecBytes || !spec.codec_file.empty()) malloc_trim(0);
#endif
  if (!codec.ok()) return codec.status();
  std::lock_guard<std::mutex> lock(mu_);
  // Checked again: another registration may have taken the name or the budget meanwhile.
  bool registered = false;
  KVCD_RETURN_IF_ERROR(CheckRegistrationLocked(spec, tenant, &registered, &limit, &limit_what));
  if (registered) return absl::OkStatus();
  // The budget counts what the pools really take (rounded by the backend); a model that
  // does not fit once rounded is refused before anything is allocated.
  KVCD_ASSIGN_OR_RETURN(auto cache, ModelCache::Create(spec, backend_.get(), config_.high_watermark,
                                                       config_.low_watermark, &counters_,
                                                       std::move(*codec), limit, limit_what));
  cache->set_memory_shares([this](const std::string& t) { return tenants_.PoolShare(t); });
  cache->set_block_observer(block_observer_);
  budget_used_ += cache->allocated_bytes();
  if (tenant != nullptr) tenants_.AddRegistration(*tenant, cache->allocated_bytes());
  models_.emplace(spec.name, std::move(cache));
  return absl::OkStatus();
}

absl::Status CacheEngine::CheckRegistrationLocked(const ModelSpec& spec, const std::string* tenant,
                                                  bool* registered, uint64_t* limit,
                                                  std::string* limit_what) const {
  *registered = false;
  auto it = models_.find(spec.name);
  if (it != models_.end()) {
    v1::ModelProfile a, b;
    ProfileFromSpec(it->second->spec(), &a);
    ProfileFromSpec(spec, &b);
    if (a.SerializeAsString() == b.SerializeAsString()) {
      *registered = true;  // idempotent
      return absl::OkStatus();
    }
    return absl::AlreadyExistsError(absl::StrCat(
        "model ", Quote(spec.name), " is already registered with a different profile"));
  }
  if (spec.memory_bytes > config_.memory_budget_bytes - budget_used_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "model ", Quote(spec.name), " asks for memory_bytes ", spec.memory_bytes, " but only ",
        config_.memory_budget_bytes - budget_used_, " of the daemon's memory_budget ",
        config_.memory_budget_bytes, " are unassigned"));
  }
  // A tenant's registrations: at most max_models, and max_model_bytes of pools in all.
  *limit = config_.memory_budget_bytes - budget_used_;
  limit_what->clear();
  if (tenant != nullptr) {
    KVCD_RETURN_IF_ERROR(
        tenants_.CheckRegistration(*tenant, spec.name, spec.memory_bytes, limit, limit_what));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelCache*> CacheEngine::FindModel(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model ", Quote(name), " is not registered; ListModels shows the models"));
  }
  return it->second.get();
}

void CacheEngine::FillModelInfo(const ModelCache& m, v1::ModelInfo* info) const {
  ProfileFromSpec(m.spec(), info->mutable_profile());
  const ModelSnapshot snap = m.Snapshot();
  for (const auto& p : snap.pools) {
    auto* pi = info->add_pools();
    pi->set_format(p.format);
    pi->set_page_bytes(static_cast<uint64_t>(p.page_bytes));
    pi->set_pages_total(static_cast<uint64_t>(p.pages_total));
    pi->set_pages_used(static_cast<uint64_t>(p.pages_used));
  }
  info->set_codec(snap.codec);
  info->set_bytes_per_token_sink(snap.bf16_bytes_per_token);
  info->set_bytes_per_token_recent(snap.bf16_bytes_per_token);
  info->set_bytes_per_token_history(snap.history_bytes_per_token);
  info->set_history_bits_per_element(snap.history_bits_per_element);
  info->set_compression_ratio(snap.compression_ratio);
  info->set_demoted_pages(snap.demoted_pages);
  info->set_cached_tokens(static_cast<uint64_t>(snap.cached_tokens));
  info->set_active_sequences(static_cast<uint64_t>(snap.active_sequences));
}

namespace {

// What SpecFromProfile cannot see: enum values the proto does not define (it would read
// them as the default), and a codec named twice.
absl::Status CheckProfileFields(const v1::RegisterModelRequest& req) {
  const v1::ModelProfile& p = req.profile();
  if (!v1::KeyNorm_IsValid(p.key_norm())) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile.key_norm is ", p.key_norm(),
                     ", not a known KeyNorm; expected KEY_NORM_NONE (0) or KEY_NORM_RMS (1)"));
  }
  if (!v1::RopePairing_IsValid(p.rope().pairing())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile.rope.pairing is ", p.rope().pairing(),
        ", not a known RopePairing; expected ROPE_PAIRING_HALF (0) or ROPE_PAIRING_INTERLEAVED "
        "(1)"));
  }
  if (!req.codec_blob().empty() && !p.codec().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile.codec is ", Quote(p.codec()),
                     " and codec_blob is set: the codec comes from one of them, set either "
                     "profile.codec or codec_blob, not both"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CacheEngine::RegisterModel(const v1::RegisterModelRequest& req,
                                        v1::RegisterModelResponse* resp) {
  KVCD_RETURN_IF_ERROR(HistoryFormatOfProto(req.profile().history_format()).status());
  KVCD_RETURN_IF_ERROR(CheckProfileFields(req));
  const ModelSpec spec = SpecFromProfile(req.profile());
  if (req.tenant().size() > kMaxSaltBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tenant has ", req.tenant().size(),
                                                   " bytes, expected at most ", kMaxSaltBytes));
  }
  KVCD_RETURN_IF_ERROR(RegisterModelSpec(spec, req.codec_blob(), &req.tenant()));
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(spec.name));
  FillModelInfo(*m, resp->mutable_model());
  return absl::OkStatus();
}

absl::Status CacheEngine::ListModels(const v1::ListModelsRequest&, v1::ListModelsResponse* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, m] : models_) FillModelInfo(*m, resp->add_models());
  return absl::OkStatus();
}

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

absl::Status CacheEngine::FetchPages(const v1::FetchPagesRequest& req, v1::FetchPagesResponse* resp,
                                     const FoundSequences& found) {
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Use(req.sequence_id(), found, 0));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
  const ModelSpec& s = seq->model->spec();
  if (req.first_token() < 0 || req.first_token() % s.page_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("first_token is ", req.first_token(),
                                                   ", expected a non-negative multiple of "
                                                   "page_size (",
                                                   s.page_size, ")"));
  }
  if (req.num_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens is ", req.num_tokens(), ", expected >= 0 (0 = to the end)"));
  }
  const int64_t len = seq->model->Length(seq.get());
  if (req.first_token() > len) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_token ", req.first_token(), " is past the sequence length ", len));
  }
  // first_token <= len here, so len - first_token cannot overflow; a num_tokens past the
  // end is refused before any arithmetic on it (first_token + num_tokens may not fit).
  if (req.num_tokens() > len - req.first_token()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_token ", req.first_token(), " + num_tokens ", req.num_tokens(),
                     " is past the sequence length ", len,
                     "; expected num_tokens <= ", len - req.first_token()));
  }
  const int64_t n = req.num_tokens() == 0 ? len - req.first_token() : req.num_tokens();
  const int64_t limit = config_.max_message_bytes - (1 << 16);
  resp->set_first_token(req.first_token());
  resp->set_num_tokens(n);
  if (req.has_destination()) {
    if (req.expand_to_bf16()) {
      return absl::InvalidArgumentError(
          "destination is set with expand_to_bf16; device destinations receive pages as stored "
          "(expand_to_bf16 = false)");
    }
    // The bytes of the pages as this sequence holds them (a recent-window page is BF16 until
    // it is demoted, wherever it sits): the destination's size once its kind is accepted.
    int64_t total = 0;
    TensorSpec spec;
    spec.field = "destination";
    spec.dtypes = TensorSpec::DTypes::kU8;
    spec.kinds = TensorResolver::kIpc | TensorResolver::kNccl;
    // The worker may still read the region's older bytes: wait for its ready event.
    spec.access = TensorSpec::Access::kOverwrite;
    spec.shape_after_payload = [&]() -> absl::StatusOr<std::vector<int64_t>> {
      KVCD_ASSIGN_OR_RETURN(total, seq->model->StoredBytes(seq.get(), req.first_token(), n));
      if (total == 0) {
        return absl::InvalidArgumentError(
            "the range holds no page; nothing to send to destination");
      }
      return std::vector<int64_t>{total};
    };
    KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes dst, tensors_.Resolve(req.destination(), spec));
    std::vector<ModelCache::StoredPageCopy> copies;
    if (!dst.is_nccl) {
      KVCD_RETURN_IF_ERROR(seq->model->FetchStoredToDevice(seq.get(), req.first_token(), n,
                                                           dst.region.ptr, total, &copies));
      KVCD_RETURN_IF_ERROR(tensors_.MarkWritten(dst.region));
    } else {
      KVCD_RETURN_IF_ERROR(
          nccl_.Send(dst.nccl_communicator, static_cast<uint64_t>(total), [&](uint8_t* staging) {
            return seq->model->FetchStoredToDevice(seq.get(), req.first_token(), n, staging, total,
                                                   &copies);
          }));
    }
    for (auto& c : copies) {
      resp->add_page_formats(c.format);
      v1::StoredPage* sp = resp->add_pages();
      sp->set_format(c.format);
      sp->set_first_token(c.first_token);
      sp->set_num_tokens(c.num_tokens);
    }
    *resp->mutable_k() = req.destination();
    return absl::OkStatus();
  }
  if (!req.expand_to_bf16()) {
    const int64_t pages = (n + s.page_size - 1) / s.page_size;
    const auto stored = CheckedMul(pages, seq->model->MaxPageBytes());
    if (!stored || *stored > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_tokens ", n, " covers pages larger than max_message_bytes (",
                       config_.max_message_bytes, "); fetch fewer tokens per call"));
    }
    std::vector<ModelCache::StoredPageCopy> copies;
    KVCD_RETURN_IF_ERROR(seq->model->FetchStored(seq.get(), req.first_token(), n, &copies));
    // The read waited for the device: a fault of a call still in flight before is known now.
    KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
    for (auto& c : copies) {
      resp->add_page_formats(c.format);
      v1::StoredPage* sp = resp->add_pages();
      sp->set_format(c.format);
      sp->set_first_token(c.first_token);
      sp->set_num_tokens(c.num_tokens);
      sp->set_data(std::move(c.data));
    }
    return absl::OkStatus();
  }
  const auto bytes = CheckedProduct({2, 2, s.num_layers, n, s.num_kv_heads, s.head_dim});
  if (!bytes || *bytes > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_tokens ", n, " would need a response larger than max_message_bytes (",
        config_.max_message_bytes, "); fetch at most ",
        limit / (4LL * s.num_layers * s.num_kv_heads * s.head_dim), " tokens per call"));
  }
  const int64_t elems = *bytes / 4;
  std::vector<uint16_t> k(static_cast<size_t>(elems)), v(static_cast<size_t>(elems));
  std::vector<std::string> formats;
  KVCD_RETURN_IF_ERROR(
      seq->model->Fetch(seq.get(), req.first_token(), n, k.data(), v.data(), &formats));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));  // as above
  const std::vector<int64_t> shape = {s.num_layers, n, s.num_kv_heads, s.head_dim};
  SetBf16Tensor(resp->mutable_k(), shape, k.data());
  SetBf16Tensor(resp->mutable_v(), shape, v.data());
  for (auto& f : formats) resp->add_page_formats(f);
  return absl::OkStatus();
}

absl::Status CacheEngine::PushPages(const v1::PushPagesRequest& req, v1::PushPagesResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  KVCD_RETURN_IF_ERROR(CheckSalt(req.cache_salt()));
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", false));
  const int64_t ps = m->spec().page_size;
  if (req.has_pages()) return PushDevicePages(*m, req, resp);
  const int64_t n_pages = req.inline_pages_size();
  const int64_t first = req.first_page();
  if (n_pages < 1) return absl::InvalidArgumentError("inline_pages is empty, expected >= 1 page");
  const auto end_pages = CheckedAdd(first, n_pages);
  const auto end_tokens = end_pages ? CheckedMul(*end_pages, ps) : std::nullopt;
  if (first < 0 || !end_tokens || *end_tokens > req.tokens_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_page ", first, " + ", n_pages, " pages of ", ps, " tokens need ",
                     end_tokens ? *end_tokens : -1, " tokens, but tokens has ", req.tokens_size()));
  }
  std::vector<ModelCache::StoredPageIn> pages;
  for (const auto& p : req.inline_pages()) pages.push_back({p.format(), p.data()});
  KVCD_ASSIGN_OR_RETURN(PutResult r, m->PushPages(req.cache_salt(), req.tokens(), first, pages));
  resp->set_inserted_tokens(r.inserted_tokens);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CacheEngine::PushedPagesBytes(const ModelCache& m,
                                                      const v1::PushPagesRequest& req) {
  const int64_t ps = m.spec().page_size;
  const int64_t n_pages = req.num_pages();
  const int64_t first = req.first_page();
  if (n_pages < 1 || n_pages > kMaxTokensPerCall) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages is ", n_pages, ", expected 1..", kMaxTokensPerCall,
                     " with pages (the count of pages in the device bytes)"));
  }
  const auto end_pages = CheckedAdd(first, n_pages);
  const auto end_tokens = end_pages ? CheckedMul(*end_pages, ps) : std::nullopt;
  if (first < 0 || !end_tokens || *end_tokens > req.tokens_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_page ", first, " + ", n_pages, " pages of ", ps, " tokens need ",
                     end_tokens ? *end_tokens : -1, " tokens, but tokens has ", req.tokens_size()));
  }
  int64_t total = 0;
  for (int64_t i = 0; i < n_pages; ++i) total += m.StoredPageBytes(first + i);
  return total;
}

absl::Status CacheEngine::PushDevicePages(ModelCache& m, const v1::PushPagesRequest& req,
                                          v1::PushPagesResponse* resp) {
  if (req.inline_pages_size() != 0) {
    return absl::InvalidArgumentError(
        "both pages and inline_pages are set; send the pages one way");
  }
  const int64_t n_pages = req.num_pages();
  const int64_t first = req.first_page();
  // The pages' bytes as this model stores them: the tensor's size once its kind is accepted.
  int64_t total = 0;
  TensorSpec spec;
  spec.field = "pages";
  spec.dtypes = TensorSpec::DTypes::kU8;
  spec.kinds = TensorResolver::kIpc | TensorResolver::kNccl;
  spec.shape_after_payload = [&]() -> absl::StatusOr<std::vector<int64_t>> {
    KVCD_ASSIGN_OR_RETURN(total, PushedPagesBytes(m, req));
    return std::vector<int64_t>{total};
  };
  KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes src, tensors_.Resolve(req.pages(), spec));
  PutResult r;
  auto store = [&](const uint8_t* src) -> absl::Status {
    auto stored = m.PushDevicePages(req.cache_salt(), req.tokens(), first, n_pages, src);
    if (!stored.ok()) return stored.status();
    r = *stored;
    return absl::OkStatus();
  };
  if (!src.is_nccl) {
    KVCD_RETURN_IF_ERROR(store(src.region.ptr));
  } else {
    KVCD_RETURN_IF_ERROR(nccl_.Receive(src.nccl_communicator, static_cast<uint64_t>(total), store));
  }
  resp->set_inserted_tokens(r.inserted_tokens);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CacheEngine::StoredPagesBytes(const v1::PushPagesRequest& req) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  return PushedPagesBytes(*m, req);
}

absl::Status CacheEngine::PushPagesFromDevice(const v1::PushPagesRequest& req,
                                              const uint8_t* device_pages, int64_t bytes,
                                              v1::PushPagesResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  KVCD_RETURN_IF_ERROR(CheckSalt(req.cache_salt()));
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", false));
  KVCD_RETURN_IF_ERROR(RequireDevice(*backend_).status());
  if (req.has_pages() || req.inline_pages_size() != 0) {
    return absl::InvalidArgumentError(
        "pages already in device memory come without pages or inline_pages");
  }
  KVCD_ASSIGN_OR_RETURN(int64_t total, PushedPagesBytes(*m, req));
  if (bytes != total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the device pages hold ", bytes, " bytes, but ", req.num_pages(), " pages from page ",
        req.first_page(), " take ", total, " bytes as this model stores them"));
  }
  KVCD_ASSIGN_OR_RETURN(PutResult r,
                        m->PushDevicePages(req.cache_salt(), req.tokens(), req.first_page(),
                                           req.num_pages(), device_pages));
  resp->set_inserted_tokens(r.inserted_tokens);
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

absl::Status CacheEngine::Stats(const v1::StatsRequest&, v1::StatsResponse* resp) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    resp->set_memory_budget_bytes(config_.memory_budget_bytes);
    for (const auto& [name, m] : models_) FillModelInfo(*m, resp->add_models());
  }
  resp->set_active_sequences(sequences_.size());
  resp->set_memory_used_bytes(MemoryUsedBytes());
  const uint64_t hit = counters_.hit_tokens.load();
  const uint64_t miss = counters_.miss_tokens.load();
  resp->set_hit_tokens(hit);
  resp->set_miss_tokens(miss);
  resp->set_hit_ratio(hit + miss == 0 ? 0.0 : static_cast<double>(hit) / (hit + miss));
  resp->set_evicted_pages(counters_.evicted_pages.load());
  const uint64_t hit_committed = counters_.hit_tokens_committed.load();
  resp->set_hit_tokens_committed(hit_committed);
  resp->set_hit_tokens_put(hit - std::min(hit, hit_committed));
  const uint64_t evicted = resp->evicted_pages();
  const uint64_t evicted_committed = counters_.evicted_pages_committed.load();
  resp->set_evicted_pages_committed(evicted_committed);
  resp->set_evicted_pages_put(evicted - std::min(evicted, evicted_committed));
  resp->set_forks(counters_.forks.load());
  uint64_t committed_pages = 0;
  for (const ModelView& mv : SnapshotModels()) {
    committed_pages += static_cast<uint64_t>(mv.snapshot.committed_pages);
  }
  resp->set_committed_pages(committed_pages);
  resp->set_demoted_pages(counters_.demoted_pages.load());
  resp->set_expired_leases(counters_.expired_leases.load());
  resp->set_member_id(member_id_);
  resp->set_incarnation(incarnation_);
  const LoadFigures load = Load();
  resp->set_queued_decode(load.queued_decode);
  resp->set_pages_used(load.pages_used);
  resp->set_pages_capacity(load.pages_capacity);
  resp->set_backend(backend_->name());
  resp->set_version(KVCD_VERSION);
  for (const TenantUsage& u : TenantUsages()) {
    v1::TenantUsage* t = resp->add_tenants();
    t->set_tenant(u.tenant);
    t->set_open_sequences(static_cast<uint64_t>(u.open_sequences));
    t->set_pinned_pages(static_cast<uint64_t>(u.pinned_pages));
    t->set_max_sequences(static_cast<uint64_t>(u.quota.max_sequences));
    t->set_max_pinned_pages(static_cast<uint64_t>(u.quota.max_pinned_pages));
    t->set_max_lease_ms(u.quota.max_lease_ms);
    t->set_held_pages(static_cast<uint64_t>(u.held_pages));
    t->set_max_memory_share(u.quota.max_memory_share);
    t->set_registered_models(static_cast<uint64_t>(u.registered_models));
    t->set_registered_model_bytes(u.registered_model_bytes);
    t->set_max_models(static_cast<uint64_t>(u.quota.max_models));
    t->set_max_model_bytes(u.quota.max_model_bytes);
    t->set_open_decode_channels(static_cast<uint64_t>(u.open_decode_channels));
    t->set_max_decode_channels(static_cast<uint64_t>(u.quota.max_decode_channels));
    t->set_pinned_prefix_pages(static_cast<uint64_t>(u.pinned_prefix_pages));
    t->set_max_pinned_prefix_pages(static_cast<uint64_t>(u.quota.max_pinned_prefix_pages));
  }
  for (const PrefixPins::Pin& p : pins_.List()) {
    v1::PrefixPin* out = resp->add_pins();
    out->set_pin_id(p.id);
    out->set_tenant(p.tenant);
    out->set_model(p.model);
    out->set_pinned_tokens(p.tokens);
    out->set_pinned_pages(p.pages);
    out->set_expires_unix_ms(p.expires_unix_ms);
  }
  return absl::OkStatus();
}

int CacheEngine::ExpireLeases(int64_t now_ns) {
  // Buffers first: a dead worker's buffer releases the device signal wait it may have left
  // on the daemon's stream (BufferRegistry::Buffer) before anything else here touches it.
  const int buffers = buffers_.ExpireLeases(now_ns);
  counters_.expired_buffers.fetch_add(static_cast<uint64_t>(buffers));
  const int sequences = sequences_.Expire(now_ns);
  counters_.expired_leases.fetch_add(static_cast<uint64_t>(sequences));
  return sequences + buffers;
}

int CacheEngine::ExpirePins(int64_t now_ns) { return pins_.Expire(now_ns); }

std::vector<CacheEngine::ModelView> CacheEngine::SnapshotModels() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ModelView> out;
  for (const auto& [name, m] : models_) out.push_back({name, m->Snapshot()});
  return out;
}

int64_t CacheEngine::ActiveSequences() const { return sequences_.size(); }

std::vector<TenantUsage> CacheEngine::TenantUsages() const {
  std::map<std::string, TenantUsage> all;
  for (TenantUsage& u : tenants_.Usage()) all[u.tenant] = std::move(u);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, m] : models_) {
    for (const TenantPagesSnapshot& t : m->Snapshot().tenants) {
      auto [it, added] = all.try_emplace(t.tenant);
      if (added) {
        it->second.tenant = t.tenant;
        it->second.quota = tenants_.Quota(t.tenant);
      }
      for (int64_t pages : t.pages) it->second.held_pages += pages;
    }
  }
  std::vector<TenantUsage> out;
  for (auto& [name, u] : all) out.push_back(std::move(u));
  return out;
}

void CacheEngine::ReplayBlocks(BlockObserver* to) {
  std::vector<ModelCache*> caches;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [name, m] : models_) caches.push_back(m.get());  // never removed
  }
  for (ModelCache* c : caches) c->ReplayBlocks(to);
}

CacheEngine::LoadFigures CacheEngine::Load() const {
  LoadFigures f;
  for (const auto& mv : SnapshotModels()) {
    for (const auto& p : mv.snapshot.pools) {
      f.pages_used += static_cast<uint64_t>(std::max<int32_t>(0, p.pages_used));
      f.pages_capacity += static_cast<uint64_t>(std::max<int32_t>(0, p.pages_total));
      f.max_page_bytes = std::max(f.max_page_bytes, static_cast<uint64_t>(p.page_bytes));
    }
  }
  f.open_sequences = static_cast<uint64_t>(std::max<int64_t>(0, sequences_.size()));
  f.queued_decode = decode_in_flight_.load();
  return f;
}

uint64_t CacheEngine::MemoryUsedBytes() const {
  uint64_t used = 0;
  for (const auto& mv : SnapshotModels()) {
    for (const auto& p : mv.snapshot.pools)
      used += static_cast<uint64_t>(p.page_bytes) * p.pages_used;
  }
  return used;
}

}  // namespace kvcd
