#include "server/engine/cache_engine.h"

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
#include "server/engine/tensor_checks.h"

namespace kvcd {
namespace {

constexpr int64_t kMaxTokensPerCall = int64_t{1} << 24;
constexpr int kMaxSaltBytes = 256;
constexpr int kMaxBatch = 1024;

absl::Status CheckSalt(const std::string& salt) {
  if (salt.size() > kMaxSaltBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache_salt has ", salt.size(), " bytes, expected at most ", kMaxSaltBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckTokens(const google::protobuf::RepeatedField<int32_t>& tokens, const char* field,
                         bool allow_empty) {
  const int64_t n = tokens.size();
  if (n == 0 && !allow_empty) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty, expected at least 1 token"));
  }
  if (n > kMaxTokensPerCall) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", n, " tokens, expected at most ",
                                                   kMaxTokensPerCall, " per call"));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[static_cast<int>(i)] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] is ",
                                                     tokens[static_cast<int>(i)],
                                                     ", expected a non-negative token id"));
    }
  }
  return absl::OkStatus();
}

// The history formats this daemon stores. Anything else (an undefined enum value, or a
// defined format whose backend is not built yet) is refused rather than served as BF16.
absl::Status CheckHistoryFormat(int format) {
  switch (format) {
    case v1::HISTORY_FORMAT_UNSPECIFIED:
    case v1::HISTORY_FORMAT_BF16:
    case v1::HISTORY_FORMAT_INT2_OSCAR:
    case v1::HISTORY_FORMAT_FSQ:
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("profile.history_format is ", format,
                       ", not a known HistoryFormat; expected HISTORY_FORMAT_BF16 (1), "
                       "HISTORY_FORMAT_INT2_OSCAR (2) or HISTORY_FORMAT_FSQ (3)"));
  }
}

}  // namespace

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
  s.history_format = p.history_format() == v1::HISTORY_FORMAT_INT2_OSCAR ? FormatId::kInt2Oscar
                     : p.history_format() == v1::HISTORY_FORMAT_FSQ      ? FormatId::kFsq
                                                                         : FormatId::kBf16;
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
  p->set_history_format(s.history_format == FormatId::kInt2Oscar ? v1::HISTORY_FORMAT_INT2_OSCAR
                        : s.history_format == FormatId::kFsq     ? v1::HISTORY_FORMAT_FSQ
                                                                 : v1::HISTORY_FORMAT_BF16);
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
      sequences_(LeasePolicy{config.default_lease_ms, config.max_lease_ms}, config.max_sequences,
                 config.quotas) {}

CacheEngine::~CacheEngine() = default;

absl::Status CacheEngine::RegisterModelSpec(const ModelSpec& spec, const std::string& codec_blob,
                                            const std::string* tenant) {
  KVCD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = models_.find(spec.name);
  if (it != models_.end()) {
    v1::ModelProfile a, b;
    ProfileFromSpec(it->second->spec(), &a);
    ProfileFromSpec(spec, &b);
    if (a.SerializeAsString() == b.SerializeAsString()) return absl::OkStatus();  // idempotent
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
  uint64_t limit = config_.memory_budget_bytes - budget_used_;
  std::string limit_what;
  if (tenant != nullptr) {
    const TenantQuota& q = config_.quotas.For(*tenant);
    const auto found = registered_.find(*tenant);
    const Registered r = found == registered_.end() ? Registered{} : found->second;
    if (q.max_models > 0 && r.models >= q.max_models) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tenant ", Quote(*tenant), " has registered ", r.models,
                       " models; its quota max_models is ", q.max_models, "; model ",
                       Quote(spec.name), " was not registered"));
    }
    if (q.max_model_bytes > 0) {
      const uint64_t left = q.max_model_bytes - std::min(q.max_model_bytes, r.bytes);
      limit_what = absl::StrCat("tenant ", Quote(*tenant), "'s quota max_model_bytes ",
                                q.max_model_bytes, " (", r.bytes, " bytes registered already)");
      if (spec.memory_bytes > left) {
        return absl::ResourceExhaustedError(
            absl::StrCat("model ", Quote(spec.name), " asks for memory_bytes ", spec.memory_bytes,
                         " but only ", left, " bytes are left under ", limit_what));
      }
      if (left < limit) {
        limit = left;
      } else {
        limit_what.clear();
      }
    }
  }
  // The budget counts what the pools really take (rounded by the backend); a model that
  // does not fit once rounded is refused before anything is allocated.
  KVCD_ASSIGN_OR_RETURN(auto cache, ModelCache::Create(spec, backend_.get(), config_.high_watermark,
                                                       config_.low_watermark, &counters_,
                                                       codec_blob, limit, limit_what));
  cache->set_memory_shares(
      [this](const std::string& t) { return config_.quotas.For(t).max_memory_share; });
  budget_used_ += cache->allocated_bytes();
  if (tenant != nullptr) {
    Registered& r = registered_[*tenant];
    ++r.models;
    r.bytes += cache->allocated_bytes();
  }
  models_.emplace(spec.name, std::move(cache));
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

absl::Status CacheEngine::RegisterModel(const v1::RegisterModelRequest& req,
                                        v1::RegisterModelResponse* resp) {
  KVCD_RETURN_IF_ERROR(CheckHistoryFormat(req.profile().history_format()));
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
  KVCD_RETURN_IF_ERROR(CheckKv(m->spec(), req.k(), req.v(), n - first));
  KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.k(), "k", kInputKinds));
  KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.v(), "v", kInputKinds));
  KVCD_ASSIGN_OR_RETURN(RowSource k, Rows(req.k(), "k", n - first, m->spec()));
  KVCD_ASSIGN_OR_RETURN(RowSource v, Rows(req.v(), "v", n - first, m->spec()));
  std::string x_staging;
  KVCD_ASSIGN_OR_RETURN(RowSource x, Residuals(req.x(), req.has_x(), "x", m->spec().num_layers,
                                               n - first, m->spec(), &x_staging));
  KVCD_ASSIGN_OR_RETURN(PutResult r, m->Put(req.cache_salt(), req.tokens(), first, k, v,
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
  const int64_t matched = m->Match(req.cache_salt(), req.tokens());
  resp->set_matched_tokens(matched);
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

absl::StatusOr<std::string> CacheEngine::SequenceSalt(uint64_t id) const {
  return sequences_.Salt(id);
}

absl::Status CacheEngine::CloseSequence(const v1::CloseSequenceRequest& req,
                                        v1::CloseSequenceResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(int64_t length, sequences_.Close(req.sequence_id()));
  resp->set_length(length);
  return absl::OkStatus();
}

absl::Status CacheEngine::RenewLease(const v1::RenewLeaseRequest& req,
                                     v1::RenewLeaseResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Find(req.sequence_id()));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
  KVCD_ASSIGN_OR_RETURN(int64_t lease, sequences_.Renew(req.sequence_id(), req.lease_ms()));
  resp->set_lease_ms(lease);
  return absl::OkStatus();
}

absl::Status CacheEngine::Append(const v1::AppendRequest& req, v1::AppendResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Find(req.sequence_id()));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
  const ModelSpec& s = seq->model->spec();
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", false));
  const int64_t n = req.tokens_size();
  KVCD_RETURN_IF_ERROR(CheckKv(s, req.k(), req.v(), n));
  KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.k(), "k", kInputKinds));
  KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.v(), "v", kInputKinds));
  KVCD_ASSIGN_OR_RETURN(RowSource k, Rows(req.k(), "k", n, s));
  KVCD_ASSIGN_OR_RETURN(RowSource v, Rows(req.v(), "v", n, s));
  std::string x_staging;
  KVCD_ASSIGN_OR_RETURN(RowSource x,
                        Residuals(req.x(), req.has_x(), "x", s.num_layers, n, s, &x_staging));
  // The tenant's max_pinned_pages quota covers the pages this append adds.
  const int64_t before = seq->model->Length(seq.get());
  KVCD_RETURN_IF_ERROR(sequences_.ReservePages(*seq, (before + n + s.page_size - 1) / s.page_size));
  absl::StatusOr<int64_t> len =
      seq->model->Append(seq.get(), req.tokens(), k, v, x.data != nullptr ? &x : nullptr);
  sequences_.Settle(*seq, (seq->model->Length(seq.get()) + s.page_size - 1) / s.page_size);
  if (!len.ok()) return len.status();
  resp->set_length(*len);
  return absl::OkStatus();
}

absl::Status CacheEngine::AttentionDecode(const v1::AttentionDecodeRequest& req,
                                          v1::AttentionDecodeResponse* resp) {
  // Host time of each step (PhaseTimes, off unless KVCD_PHASE_TIMES=1).
  static const int kValidate = PhaseTimes::Phase("daemon.engine.validate (+k/v resolve)");
  static const int kIo = PhaseTimes::Phase("daemon.engine.resolve q/o/lse");
  static const int kReserve = PhaseTimes::Phase("daemon.engine.quota reserve");
  static const int kAttend = PhaseTimes::Phase("daemon.engine.attend (cache+backend)");
  static const int kWritten = PhaseTimes::Phase("daemon.engine.mark written");
  PhaseLap lap;
  TensorResolver::CallScope one_wait_per_buffer;  // q, k_new, v_new: one ready event
  resp->Clear();
  resp->set_request_id(req.request_id());
  const int64_t batch = req.sequence_ids_size();
  if (batch < 1 || batch > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence_ids has ", batch, " entries, expected 1..", kMaxBatch));
  }
  std::vector<std::shared_ptr<Sequence>> seqs;
  std::unordered_set<uint64_t> seen;
  for (int64_t b = 0; b < batch; ++b) {
    const uint64_t id = req.sequence_ids(static_cast<int>(b));
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequence_ids[", b, "] = ", id,
                                                     " appears twice; a batch needs distinct ids"));
    }
    KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Find(id));
    if (absl::Status f = DeviceFaultStatus(*seq); !f.ok()) {
      return absl::Status(f.code(), absl::StrCat("sequence_ids[", b, "]: ", f.message()));
    }
    if (!seqs.empty() && seq->model != seqs.front()->model) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence_ids[", b, "] belongs to model '", seq->model->spec().name,
                       "', expected every sequence of the batch on model '",
                       seqs.front()->model->spec().name, "'"));
    }
    seqs.push_back(std::move(seq));
  }
  ModelCache* m = seqs.front()->model;
  const ModelSpec& s = m->spec();
  if (req.layer() < 0 || req.layer() >= s.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer is ", req.layer(), ", expected 0..", s.num_layers - 1));
  }
  KVCD_RETURN_IF_ERROR(CheckTensorRef(req.q(), "q", {batch, s.num_q_heads, s.head_dim},
                                      {v1::DTYPE_BF16, v1::DTYPE_F32}));
  KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.q(), "q", kInputKinds));
  const bool device_out = req.has_o_out() || req.has_lse_out();
  if (device_out) {
    KVCD_RETURN_IF_ERROR(
        CheckTensorRef(req.o_out(), "o_out", {batch, s.num_q_heads, s.head_dim}, {v1::DTYPE_F32}));
    KVCD_RETURN_IF_ERROR(
        CheckTensorRef(req.lse_out(), "lse_out", {batch, s.num_q_heads}, {v1::DTYPE_F32}));
    KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.o_out(), "o_out", TensorResolver::kIpc));
    KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.lse_out(), "lse_out", TensorResolver::kIpc));
  }
  if (!std::isfinite(req.softmax_scale()) || req.softmax_scale() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("softmax_scale is ", req.softmax_scale(),
                     ", expected a finite value >= 0 (0 = 1/sqrt(d))"));
  }
  const bool fused = req.has_k_new() || req.has_v_new();
  ModelCache::NewTokens new_tokens;
  std::string x_staging;
  RowSource x_new;
  if (fused) {
    const std::vector<int64_t> shape = {batch, s.num_kv_heads, s.head_dim};
    KVCD_RETURN_IF_ERROR(
        CheckTensorRef(req.k_new(), "k_new", shape, {v1::DTYPE_BF16, v1::DTYPE_F32}));
    KVCD_RETURN_IF_ERROR(
        CheckTensorRef(req.v_new(), "v_new", shape, {v1::DTYPE_BF16, v1::DTYPE_F32}));
    KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.k_new(), "k_new", kInputKinds));
    KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.v_new(), "v_new", kInputKinds));
    if (req.new_tokens_size() != batch) {
      return absl::InvalidArgumentError(absl::StrCat("new_tokens has ", req.new_tokens_size(),
                                                     " entries, expected one per sequence (", batch,
                                                     ")"));
    }
    KVCD_RETURN_IF_ERROR(CheckTokens(req.new_tokens(), "new_tokens", false));
    // Device rows (CUDA IPC) are stored on the device straight from the worker's buffer.
    KVCD_ASSIGN_OR_RETURN(new_tokens.k, Rows(req.k_new(), "k_new", batch, s));
    KVCD_ASSIGN_OR_RETURN(new_tokens.v, Rows(req.v_new(), "v_new", batch, s));
    KVCD_ASSIGN_OR_RETURN(
        x_new, Residuals(req.x_new(), req.has_x_new(), "x_new", 0, batch, s, &x_staging));
    if (x_new.data != nullptr) new_tokens.x = &x_new;
    new_tokens.tokens = req.new_tokens();
  } else if (req.new_tokens_size() != 0) {
    return absl::InvalidArgumentError("new_tokens is set without k_new/v_new");
  } else if (req.has_x_new()) {
    return absl::InvalidArgumentError("x_new is set without k_new/v_new");
  }
  const int64_t q_elems = batch * s.num_q_heads * s.head_dim;
  const float scale = req.softmax_scale() == 0 ? 1.0f / std::sqrt(static_cast<float>(s.head_dim))
                                               : req.softmax_scale();
  // Queries and results: host (inline) or the worker's device buffers (cuda_ipc).
  lap.Mark(kValidate);
  ModelCache::DeviceIo device;
  BufferRegistry::Region q_region, o_region, lse_region;
  std::vector<float> q;
  const bool device_q = req.q().payload_case() == v1::TensorRef::kCudaIpc;
  // Device queries with device outputs stay on the device: the query conversion checks them
  // and marks a sequence with a NaN/±Inf (its outputs are NaN, its next call fails), so the
  // call does not wait. That needs every sequence's fault words; else they come to the host
  // and are scanned.
  bool q_on_device = device_q && device_out;
  for (const auto& sq : seqs) q_on_device = q_on_device && sq->device_fault.held();
  if (device_q) {
    KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes qb, tensors_.Input(req.q(), "q"));
    q_region = qb.region;
  }
  if (!q_on_device) {
    std::string q_staging;
    KVCD_ASSIGN_OR_RETURN(const char* q_bytes, tensors_.HostInput(req.q(), "q", &q_staging));
    TensorResolver::Bytes host_q;
    host_q.data = q_bytes;
    KVCD_RETURN_IF_ERROR(tensors_.CheckFinite(host_q, req.q(), "q"));
    q.resize(static_cast<size_t>(q_elems));
    if (req.q().dtype() == v1::DTYPE_F32) {
      std::memcpy(q.data(), q_bytes, q.size() * sizeof(float));
    } else {
      for (int64_t i = 0; i < q_elems; ++i) {
        uint16_t h;
        std::memcpy(&h, q_bytes + 2 * i, 2);
        q[static_cast<size_t>(i)] = kernels::Bf16ToFloat(h);
      }
    }
  }
  if (device_out) {
    KVCD_ASSIGN_OR_RETURN(o_region, tensors_.Output(req.o_out(), "o_out", false));
    KVCD_ASSIGN_OR_RETURN(lse_region, tensors_.Output(req.lse_out(), "lse_out", false));
    if (q_on_device) {
      device.q = q_region.ptr;
      device.q_bf16 = req.q().dtype() == v1::DTYPE_BF16;
    } else {  // host queries, device results: the queries go up first
      auto* staged = reinterpret_cast<float*>(o_region.ptr);
      KVCD_ASSIGN_OR_RETURN(DeviceRuntime * dev, RequireDevice(*backend_));
      KVCD_RETURN_IF_ERROR(dev->CopyHostToDevice(staged, q.data(), q.size() * sizeof(float)));
      device.q = staged;  // o_out has the queries' shape; the merge overwrites it last
      device.q_bf16 = false;
    }
    device.o = reinterpret_cast<float*>(o_region.ptr);
    device.lse = reinterpret_cast<float*>(lse_region.ptr);
    *resp->mutable_o() = req.o_out();
    *resp->mutable_lse() = req.lse_out();
  } else {
    v1::TensorRef* o = resp->mutable_o();
    o->set_dtype(v1::DTYPE_F32);
    o->add_shape(batch);
    o->add_shape(s.num_q_heads);
    o->add_shape(s.head_dim);
    o->mutable_inline_data()->resize(static_cast<size_t>(q_elems) * sizeof(float));
    v1::TensorRef* lse = resp->mutable_lse();
    lse->set_dtype(v1::DTYPE_F32);
    lse->add_shape(batch);
    lse->add_shape(s.num_q_heads);
    lse->mutable_inline_data()->resize(static_cast<size_t>(batch * s.num_q_heads) * sizeof(float));
  }
  lap.Mark(kIo);
  std::vector<Sequence*> raw;
  for (auto& sq : seqs) raw.push_back(sq.get());
  // Whatever happens below, each sequence's pages are recorded as they end up (this also
  // undoes the reservations of a batch refused half-way).
  struct SettleOnExit {
    std::function<void()> fn;
    ~SettleOnExit() { fn(); }
  } settle{[&] {
    if (!fused) return;
    for (auto& sq : seqs) {
      sequences_.Settle(*sq, (m->Length(sq.get()) + s.page_size - 1) / s.page_size);
    }
  }};
  if (fused) {  // one token more per sequence: at most one page more, under the tenant's quota
    for (auto& sq : seqs) {
      const int64_t next = m->Length(sq.get()) + 1;
      KVCD_RETURN_IF_ERROR(sequences_.ReservePages(*sq, (next + s.page_size - 1) / s.page_size));
    }
  }
  std::vector<int64_t> lengths;
  lap.Mark(kReserve);
  const auto t0 = std::chrono::steady_clock::now();
  if (device_out) {
    KVCD_RETURN_IF_ERROR(m->Attend(req.layer(), raw, nullptr, scale, new_tokens, nullptr, nullptr,
                                   &lengths, &device));
    lap.Mark(kAttend);
    KVCD_RETURN_IF_ERROR(tensors_.MarkWritten(o_region));
    if (lse_region.buffer != o_region.buffer)
      KVCD_RETURN_IF_ERROR(tensors_.MarkWritten(lse_region));
    lap.Mark(kWritten);
  } else {
    KVCD_RETURN_IF_ERROR(m->Attend(
        req.layer(), raw, q.data(), scale, new_tokens,
        reinterpret_cast<float*>(resp->mutable_o()->mutable_inline_data()->data()),
        reinterpret_cast<float*>(resp->mutable_lse()->mutable_inline_data()->data()), &lengths));
    lap.Mark(kAttend);
    // Host results: the call waited for its kernels, so a NaN/±Inf they met is known now.
    for (size_t b = 0; b < seqs.size(); ++b) {
      if (absl::Status f = DeviceFaultStatus(*seqs[b], /*this_call=*/true); !f.ok()) {
        return absl::Status(f.code(), absl::StrCat("sequence_ids[", b, "]: ", f.message()));
      }
    }
  }
  resp->set_kernel_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  for (int64_t l : lengths) resp->add_lengths(l);
  return absl::OkStatus();
}

absl::Status CacheEngine::FetchPages(const v1::FetchPagesRequest& req,
                                     v1::FetchPagesResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Find(req.sequence_id()));
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
    KVCD_RETURN_IF_ERROR(tensors_.CheckPayload(req.destination(), "destination",
                                               TensorResolver::kIpc | TensorResolver::kNccl));
    // The bytes of the pages as this sequence holds them (a recent-window page is BF16 until
    // it is demoted, wherever it sits).
    KVCD_ASSIGN_OR_RETURN(const int64_t total,
                          seq->model->StoredBytes(seq.get(), req.first_token(), n));
    if (total == 0) {
      return absl::InvalidArgumentError("the range holds no page; nothing to send to destination");
    }
    KVCD_RETURN_IF_ERROR(CheckTensorRef(req.destination(), "destination", {total}, {v1::DTYPE_U8}));
    std::vector<ModelCache::StoredPageCopy> copies;
    if (req.destination().payload_case() == v1::TensorRef::kCudaIpc) {
      // The worker may still read the region's older bytes: wait for its ready event.
      KVCD_ASSIGN_OR_RETURN(BufferRegistry::Region r,
                            tensors_.Output(req.destination(), "destination", true));
      KVCD_RETURN_IF_ERROR(
          seq->model->FetchStoredToDevice(seq.get(), req.first_token(), n, r.ptr, total, &copies));
      KVCD_RETURN_IF_ERROR(tensors_.MarkWritten(r));
    } else {
      KVCD_RETURN_IF_ERROR(nccl_.Send(req.destination().nccl().communicator_id(),
                                      static_cast<uint64_t>(total), [&](uint8_t* staging) {
                                        return seq->model->FetchStoredToDevice(
                                            seq.get(), req.first_token(), n, staging, total,
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

absl::Status CacheEngine::PushDevicePages(ModelCache& m, const v1::PushPagesRequest& req,
                                          v1::PushPagesResponse* resp) {
  if (req.inline_pages_size() != 0) {
    return absl::InvalidArgumentError(
        "both pages and inline_pages are set; send the pages one way");
  }
  KVCD_RETURN_IF_ERROR(
      tensors_.CheckPayload(req.pages(), "pages", TensorResolver::kIpc | TensorResolver::kNccl));
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
  KVCD_RETURN_IF_ERROR(CheckTensorRef(req.pages(), "pages", {total}, {v1::DTYPE_U8}));
  PutResult r;
  auto store = [&](const uint8_t* src) -> absl::Status {
    auto stored = m.PushDevicePages(req.cache_salt(), req.tokens(), first, n_pages, src);
    if (!stored.ok()) return stored.status();
    r = *stored;
    return absl::OkStatus();
  };
  if (req.pages().payload_case() == v1::TensorRef::kCudaIpc) {
    KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes b, tensors_.Input(req.pages(), "pages"));
    KVCD_RETURN_IF_ERROR(store(b.region.ptr));
  } else {
    KVCD_RETURN_IF_ERROR(
        nccl_.Receive(req.pages().nccl().communicator_id(), static_cast<uint64_t>(total), store));
  }
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
  resp->set_demoted_pages(counters_.demoted_pages.load());
  resp->set_expired_leases(counters_.expired_leases.load());
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
  }
  return absl::OkStatus();
}

int CacheEngine::ExpireLeases(int64_t now_ns) {
  const int sequences = sequences_.Expire(now_ns);
  counters_.expired_leases.fetch_add(static_cast<uint64_t>(sequences));
  const int buffers = buffers_.ExpireLeases(now_ns);
  counters_.expired_buffers.fetch_add(static_cast<uint64_t>(buffers));
  return sequences + buffers;
}

std::vector<CacheEngine::ModelView> CacheEngine::SnapshotModels() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ModelView> out;
  for (const auto& [name, m] : models_) out.push_back({name, m->Snapshot()});
  return out;
}

int64_t CacheEngine::ActiveSequences() const { return sequences_.size(); }

std::vector<TenantUsage> CacheEngine::TenantUsages() const {
  std::map<std::string, TenantUsage> all;
  for (TenantUsage& u : sequences_.Usage()) all[u.tenant] = std::move(u);
  auto entry = [&](const std::string& tenant) -> TenantUsage& {
    auto [it, added] = all.try_emplace(tenant);
    if (added) {
      it->second.tenant = tenant;
      it->second.quota = config_.quotas.For(tenant);
    }
    return it->second;
  };
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, m] : models_) {
    for (const TenantPagesSnapshot& t : m->Snapshot().tenants) {
      for (int64_t pages : t.pages) entry(t.tenant).held_pages += pages;
    }
  }
  for (const auto& [tenant, r] : registered_) {
    TenantUsage& u = entry(tenant);
    u.registered_models = r.models;
    u.registered_model_bytes = r.bytes;
  }
  std::vector<TenantUsage> out;
  for (auto& [name, u] : all) out.push_back(std::move(u));
  return out;
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
