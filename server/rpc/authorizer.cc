#include "server/rpc/authorizer.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/engine/prefix_pins.h"

namespace kvcd {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

std::string TenantList(const Principal& p) {
  if (p.tenants.empty()) return "none";
  std::vector<std::string> quoted;
  for (const auto& t : p.tenants) quoted.push_back(absl::StrCat("'", t, "'"));
  return absl::StrJoin(quoted, ", ");
}

// Appends every CudaIpcRegion.buffer_id and NcclSlot.communicator_id set in m.
void CollectRefs(const Message& m, std::vector<std::pair<Authorizer::Object, uint64_t>>* out) {
  if (const auto* r = dynamic_cast<const v1::CudaIpcRegion*>(&m)) {
    out->emplace_back(Authorizer::Object::kBuffer, r->buffer_id());
    return;
  }
  if (const auto* s = dynamic_cast<const v1::NcclSlot*>(&m)) {
    out->emplace_back(Authorizer::Object::kCommunicator, s->communicator_id());
    return;
  }
  const auto* refl = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  refl->ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (f->is_repeated()) {
      const int n = refl->FieldSize(m, f);
      for (int i = 0; i < n; ++i) CollectRefs(refl->GetRepeatedMessage(m, f, i), out);
    } else {
      CollectRefs(refl->GetMessage(m, f), out);
    }
  }
}

}  // namespace

absl::Status Authorizer::CheckTenant(const Principal& p, const std::string& salt) const {
  if (p.MayUseTenant(salt)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("token '", p.name,
                                                  "' may not use tenant (cache_salt) ", Quote(salt),
                                                  "; its tenants are: ", TenantList(p)));
}

absl::Status Authorizer::CheckSequence(const Principal& p, uint64_t id,
                                       FoundSequences* found) const {
  if (p.unrestricted) return absl::OkStatus();
  absl::StatusOr<std::shared_ptr<Sequence>> seq = lookup_(id);
  if (!seq.ok()) return seq.status();
  if (p.MayUseTenant((*seq)->salt)) {
    if (found != nullptr) found->push_back(*std::move(seq));
    return absl::OkStatus();
  }
  // Exactly the answer for a sequence that does not exist: no probing across tenants.
  return absl::NotFoundError(
      absl::StrCat("sequence ", id, " is not open (never opened, closed, or its lease expired)"));
}

absl::Status Authorizer::CheckDataPlane(const Principal& p, const char* what) const {
  if (p.data_plane) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("token '", p.name, "' may not ", what,
                                                  " (needs data_plane: true in the tokens file)"));
}

absl::Status Authorizer::CheckOwner(const Principal& p, Object kind, uint64_t id) const {
  if (p.unrestricted) return absl::OkStatus();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find({kind, id});
    // Unknown ids go on to the engine, which answers NOT_FOUND.
    if (it == owners_.end() || it->second == p.name) return absl::OkStatus();
  }
  switch (kind) {
    case Object::kBuffer:
      return absl::NotFoundError(absl::StrCat("buffer ", id, " is not registered"));
    case Object::kCommunicator:
      return absl::NotFoundError(absl::StrCat("NCCL communicator ", id,
                                              " does not exist (never connected, or "
                                              "disconnected); call NcclConnect"));
    case Object::kChannel:
      break;
  }
  return absl::NotFoundError(absl::StrCat(
      "decode channel ", id, " is not open (closed, idle past its lease, or never opened)"));
}

absl::Status Authorizer::CheckRefs(const Principal& p, const Message& m) const {
  if (p.unrestricted) return absl::OkStatus();
  std::vector<std::pair<Object, uint64_t>> refs;
  CollectRefs(m, &refs);
  if (refs.empty()) return absl::OkStatus();
  KVCD_RETURN_IF_ERROR(CheckDataPlane(p, "name cuda_ipc buffers or nccl communicators"));
  for (const auto& [kind, id] : refs) KVCD_RETURN_IF_ERROR(CheckOwner(p, kind, id));
  return absl::OkStatus();
}

void Authorizer::Bind(Object kind, uint64_t id, const Principal& p) {
  if (p.unrestricted) return;
  std::lock_guard<std::mutex> lock(mu_);
  owners_[{kind, id}] = p.name;
}

void Authorizer::Unbind(Object kind, uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  owners_.erase({kind, id});
}

absl::Status Authorizer::Check(const Principal& p, const v1::RegisterModelRequest& r) const {
  if (!p.register_models) {
    return absl::PermissionDeniedError(
        absl::StrCat("token '", p.name,
                     "' may not register models (needs register_models: true in the "
                     "tokens file)"));
  }
  return CheckTenant(p, r.tenant());  // the registration counts against this tenant
}
absl::Status Authorizer::Check(const Principal&, const v1::ListModelsRequest&) const {
  return absl::OkStatus();
}
absl::Status Authorizer::Check(const Principal&, const v1::StatsRequest&) const {
  return absl::OkStatus();
}
absl::Status Authorizer::Check(const Principal& p, const v1::PinPrefixRequest& r) const {
  return CheckTenant(p, r.cache_salt());
}
absl::Status Authorizer::Check(const Principal& p, const v1::UnpinPrefixRequest& r) const {
  if (p.unrestricted || pin_tenant_ == nullptr) return absl::OkStatus();
  absl::StatusOr<std::string> tenant = pin_tenant_(r.pin_id());
  if (!tenant.ok()) return tenant.status();
  if (p.MayUseTenant(*tenant)) return absl::OkStatus();
  // Exactly the answer for a pin that is not live: no probing across tenants.
  return PrefixPins::NotLive(r.pin_id());
}
namespace {

bool SeesEverything(const Principal& p) { return p.unrestricted || p.all_tenants; }

// A model's configuration stays; what every tenant's use of it shows goes.
void ClearActivity(v1::ModelInfo* m) {
  m->clear_cached_tokens();
  m->clear_active_sequences();
  m->clear_compression_ratio();
  m->clear_demoted_pages();
  for (v1::PoolInfo& pool : *m->mutable_pools()) pool.clear_pages_used();
}

}  // namespace

void Authorizer::Scope(const Principal& p, v1::StatsResponse* r) const {
  if (SeesEverything(p)) return;
  google::protobuf::RepeatedPtrField<v1::TenantUsage> tenants;
  for (v1::TenantUsage& t : *r->mutable_tenants()) {
    if (p.MayUseTenant(t.tenant())) *tenants.Add() = std::move(t);
  }
  r->mutable_tenants()->Swap(&tenants);
  google::protobuf::RepeatedPtrField<v1::PrefixPin> pins;
  for (v1::PrefixPin& pin : *r->mutable_pins()) {
    if (p.MayUseTenant(pin.tenant())) *pins.Add() = std::move(pin);
  }
  r->mutable_pins()->Swap(&pins);
  for (v1::ModelInfo& m : *r->mutable_models()) ClearActivity(&m);
  r->clear_memory_used_bytes();
  r->clear_hit_tokens();
  r->clear_miss_tokens();
  r->clear_hit_ratio();
  r->clear_evicted_pages();
  r->clear_demoted_pages();
  r->clear_active_sequences();
  r->clear_expired_leases();
  // Cluster load figures add up every tenant's use too (member_id, incarnation and
  // pages_capacity are configuration and stay).
  r->clear_pages_used();
  r->clear_queued_decode();
  r->clear_committed_pages();
  r->clear_forks();
  r->clear_hit_tokens_put();
  r->clear_hit_tokens_committed();
  r->clear_evicted_pages_put();
  r->clear_evicted_pages_committed();
}

void Authorizer::Scope(const Principal& p, v1::ListModelsResponse* r) const {
  if (SeesEverything(p)) return;
  for (v1::ModelInfo& m : *r->mutable_models()) ClearActivity(&m);
}

absl::Status Authorizer::Check(const Principal& p, const v1::PutRequest& r) const {
  KVCD_RETURN_IF_ERROR(CheckTenant(p, r.cache_salt()));
  return CheckRefs(p, r);
}
absl::Status Authorizer::Check(const Principal& p, const v1::MatchRequest& r) const {
  return CheckTenant(p, r.cache_salt());
}
absl::Status Authorizer::Check(const Principal& p, const v1::OpenSequenceRequest& r) const {
  return CheckTenant(p, r.cache_salt());
}
// PullPrefix: the tenant whose pages are pulled (and stored here) must be the caller's; the
// peer checks the same token again.
absl::Status Authorizer::Check(const Principal& p, const v1::PullPrefixRequest& r) const {
  return CheckTenant(p, r.cache_salt());
}
absl::Status Authorizer::Check(const Principal& p, const v1::PushPagesRequest& r) const {
  KVCD_RETURN_IF_ERROR(CheckTenant(p, r.cache_salt()));
  return CheckRefs(p, r);
}
absl::Status Authorizer::Check(const Principal& p, const v1::CloseSequenceRequest& r,
                               FoundSequences* found) const {
  return CheckSequence(p, r.sequence_id(), found);
}
absl::Status Authorizer::Check(const Principal& p, const v1::RenewLeaseRequest& r,
                               FoundSequences* found) const {
  return CheckSequence(p, r.sequence_id(), found);
}
absl::Status Authorizer::Check(const Principal& p, const v1::CommitSequenceRequest& r,
                               FoundSequences* found) const {
  return CheckSequence(p, r.sequence_id(), found);
}
absl::Status Authorizer::Check(const Principal& p, const v1::ForkSequenceRequest& r,
                               FoundSequences* found) const {
  return CheckSequence(p, r.sequence_id(), found);
}
absl::Status Authorizer::Check(const Principal& p, const v1::AppendRequest& r,
                               FoundSequences* found) const {
  KVCD_RETURN_IF_ERROR(CheckSequence(p, r.sequence_id(), found));
  return CheckRefs(p, r);
}
absl::Status Authorizer::Check(const Principal& p, const v1::AttentionDecodeRequest& r,
                               FoundSequences* found) const {
  for (int b = 0; b < r.sequence_ids_size(); ++b) {
    absl::Status s = CheckSequence(p, r.sequence_ids(b), found);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("sequence_ids[", b, "]: ", s.message()));
    }
  }
  return CheckRefs(p, r);
}
absl::Status Authorizer::Check(const Principal& p, const v1::FetchPagesRequest& r,
                               FoundSequences* found) const {
  KVCD_RETURN_IF_ERROR(CheckSequence(p, r.sequence_id(), found));
  return CheckRefs(p, r);
}
absl::Status Authorizer::Check(const Principal& p, const v1::RegisterBufferRequest&) const {
  return CheckDataPlane(p, "register buffers");
}
absl::Status Authorizer::Check(const Principal& p, const v1::UnregisterBufferRequest& r) const {
  KVCD_RETURN_IF_ERROR(CheckDataPlane(p, "unregister buffers"));
  return CheckOwner(p, Object::kBuffer, r.buffer_id());
}
absl::Status Authorizer::Check(const Principal& p, const v1::RenewBufferRequest& r) const {
  KVCD_RETURN_IF_ERROR(CheckDataPlane(p, "renew buffers"));
  return CheckOwner(p, Object::kBuffer, r.buffer_id());
}
absl::Status Authorizer::Check(const Principal& p, const v1::NcclConnectRequest&) const {
  return CheckDataPlane(p, "connect NCCL communicators");
}
absl::Status Authorizer::Check(const Principal& p, const v1::NcclDisconnectRequest& r) const {
  KVCD_RETURN_IF_ERROR(CheckDataPlane(p, "disconnect NCCL communicators"));
  return CheckOwner(p, Object::kCommunicator, r.communicator_id());
}
absl::Status Authorizer::Check(const Principal& p, const v1::OpenDecodeChannelRequest&) const {
  return CheckDataPlane(p, "open decode channels");
}
absl::Status Authorizer::Check(const Principal& p, const v1::CloseDecodeChannelRequest& r) const {
  KVCD_RETURN_IF_ERROR(CheckDataPlane(p, "close decode channels"));
  return CheckOwner(p, Object::kChannel, r.channel_id());
}

}  // namespace kvcd
