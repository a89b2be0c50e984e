// Part of CacheEngine (cache_engine.h): what the engine reports about itself: Stats,
// the models' snapshots, tenants' usage, load figures for the cluster and memory in use.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "server/engine/cache_engine.h"

namespace kvcd {

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
