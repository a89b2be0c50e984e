// Part of CacheEngine (cache_engine.h): registering models (a spec, its codec and its
// tenant's share of the budget) and describing them (ModelInfo).
#include <malloc.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/engine/cache_engine.h"
#include "server/engine/model_profile.h"
#include "server/engine/request_checks.h"
#include "server/formats/format_registry.h"

namespace kvcd {

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

}  // namespace kvcd
