#include "server/metrics/metrics.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"
#include "prometheus/gauge.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"
#include "server/metrics/family_builder.h"

namespace kvcd {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

using metrics::Add;
using metrics::Family;

// Reads the engine's state at scrape time.
class CacheCollector final : public prometheus::Collectable {
 public:
  explicit CacheCollector(const CacheEngine* engine) : engine_(engine) {}

  std::vector<MetricFamily> Collect() const override {
    const CacheCounters& c = engine_->counters();
    std::vector<MetricFamily> out;
    auto pool_bytes =
        Family("kvcd_pool_bytes", "Bytes of page pools by model, format and state (used|total).",
               MetricType::Gauge);
    auto pool_pages =
        Family("kvcd_pool_pages", "Pages of page pools by model, format and state (used|free).",
               MetricType::Gauge);
    auto cached = Family("kvcd_cached_tokens", "Tokens held in the radix prefix cache, by model.",
                         MetricType::Gauge);
    auto pinned = Family("kvcd_pinned_pages",
                         "Cached pages pinned by open sequences or prefix pins, by model.",
                         MetricType::Gauge);
    auto prefix_pins =
        Family("kvcd_prefix_pins", "Live prefix pins (PinPrefix), by model.", MetricType::Gauge);
    auto prefix_pages = Family("kvcd_pinned_prefix_pages",
                               "Pages held by live prefix pins, summed over the pins (a page "
                               "under two pins counts twice), by model.",
                               MetricType::Gauge);
    std::map<std::string, std::pair<int64_t, int64_t>> pins_of;  // model -> (pins, pages)
    for (const PrefixPins::Pin& p : engine_->Pins()) {
      ++pins_of[p.model].first;
      pins_of[p.model].second += p.pages;
    }
    auto committed = Family("kvcd_committed_pages",
                            "Cached pages that entered the prefix cache by a sequence's commit "
                            "(CommitSequence, CloseSequence with commit), by model.",
                            MetricType::Gauge);
    auto bpt = Family("kvcd_bytes_per_token",
                      "Bytes stored per token (all layers, K and V, scales included) by model and "
                      "segment (sink|history|recent).",
                      MetricType::Gauge);
    auto bits =
        Family("kvcd_history_bytes_per_element",
               "Bytes per K/V element of the history format, scales included (0.28125, i.e. "
               "2.25 bits, for int2-oscar at head_dim 128; 2 for bf16). In bytes, the base unit "
               "Prometheus naming asks for.",
               MetricType::Gauge);
    auto ratio = Family("kvcd_pool_compression_ratio",
                        "Dense-BF16 bytes of the tokens held in a model's pools divided by the "
                        "bytes of the pages in use.",
                        MetricType::Gauge);
    for (const auto& mv : engine_->SnapshotModels()) {
      for (const auto& p : mv.snapshot.pools) {
        const double pb = static_cast<double>(p.page_bytes);
        Add(&pool_bytes, pb * p.pages_used,
            {{"format", p.format}, {"model", mv.name}, {"state", "used"}});
        Add(&pool_bytes, pb * p.pages_total,
            {{"format", p.format}, {"model", mv.name}, {"state", "total"}});
        Add(&pool_pages, p.pages_used,
            {{"format", p.format}, {"model", mv.name}, {"state", "used"}});
        Add(&pool_pages, p.pages_total - p.pages_used,
            {{"format", p.format}, {"model", mv.name}, {"state", "free"}});
      }
      Add(&cached, static_cast<double>(mv.snapshot.cached_tokens), {{"model", mv.name}});
      Add(&pinned, static_cast<double>(mv.snapshot.pinned_pages), {{"model", mv.name}});
      const auto pins = pins_of[mv.name];
      Add(&prefix_pins, static_cast<double>(pins.first), {{"model", mv.name}});
      Add(&prefix_pages, static_cast<double>(pins.second), {{"model", mv.name}});
      Add(&committed, static_cast<double>(mv.snapshot.committed_pages), {{"model", mv.name}});
      Add(&bpt, mv.snapshot.bf16_bytes_per_token, {{"model", mv.name}, {"segment", "sink"}});
      Add(&bpt, mv.snapshot.history_bytes_per_token, {{"model", mv.name}, {"segment", "history"}});
      Add(&bpt, mv.snapshot.bf16_bytes_per_token, {{"model", mv.name}, {"segment", "recent"}});
      Add(&bits, mv.snapshot.history_bits_per_element / 8, {{"model", mv.name}});
      Add(&ratio, mv.snapshot.compression_ratio, {{"model", mv.name}});
    }
    out.push_back(std::move(pool_bytes));
    out.push_back(std::move(pool_pages));
    out.push_back(std::move(cached));
    out.push_back(std::move(pinned));
    out.push_back(std::move(prefix_pins));
    out.push_back(std::move(prefix_pages));
    out.push_back(std::move(committed));
    out.push_back(std::move(bpt));
    out.push_back(std::move(bits));
    out.push_back(std::move(ratio));
    auto counter = [&](const char* name, const char* help, uint64_t v) {
      auto f = Family(name, help, MetricType::Counter);
      Add(&f, static_cast<double>(v));
      out.push_back(std::move(f));
    };
    counter("kvcd_radix_hit_tokens_total",
            "Tokens found in the prefix cache by Put and OpenSequence.", c.hit_tokens.load());
    counter("kvcd_radix_miss_tokens_total",
            "Tokens looked up by Put and OpenSequence and not cached.", c.miss_tokens.load());
    counter("kvcd_inserted_pages_total", "Pages inserted into the prefix cache.",
            c.inserted_pages.load());
    counter("kvcd_evicted_pages_total", "Pages evicted from the prefix cache (LRU leaves).",
            c.evicted_pages.load());
    counter("kvcd_demoted_pages_total", "Pages demoted from BF16 to the history format.",
            c.demoted_pages.load());
    // Reuse and eviction by the origin of the pages (put: Put / PushPages; committed: a
    // sequence's commit); each pair sums to kvcd_radix_hit_tokens_total /
    // kvcd_evicted_pages_total.
    auto by_origin = [&](const char* name, const char* help, uint64_t total, uint64_t committed) {
      auto f = Family(name, help, MetricType::Counter);
      Add(&f, static_cast<double>(total - std::min(total, committed)), {{"origin", "put"}});
      Add(&f, static_cast<double>(committed), {{"origin", "committed"}});
      out.push_back(std::move(f));
    };
    by_origin("kvcd_hit_tokens_by_origin_total",
              "Tokens found in the prefix cache by Put and OpenSequence, by the origin of their "
              "pages (put|committed).",
              c.hit_tokens.load(), c.hit_tokens_committed.load());
    by_origin("kvcd_evicted_pages_by_origin_total",
              "Pages evicted from the prefix cache, by origin (put|committed).",
              c.evicted_pages.load(), c.evicted_pages_committed.load());
    counter("kvcd_forks_total", "Sequences forked (ForkSequence).", c.forks.load());
    counter("kvcd_expired_leases_total", "Sequences closed because their lease ran out.",
            c.expired_leases.load());
    counter("kvcd_attention_calls_total", "Attention-decode batches executed.",
            c.attention_calls.load());
    counter("kvcd_expired_buffers_total",
            "CUDA IPC buffers dropped because their lease ran out (a worker stopped renewing).",
            c.expired_buffers.load());
    counter("kvcd_expired_pins_total", "Prefix pins removed because their ttl ran out.",
            engine_->ExpiredPins());
    auto buffers = Family("kvcd_registered_buffers",
                          "Worker device buffers mapped through CUDA IPC.", MetricType::Gauge);
    Add(&buffers, static_cast<double>(engine_->RegisteredBuffers()));
    out.push_back(std::move(buffers));
    auto comms =
        Family("kvcd_nccl_communicators", "NCCL communicators with workers.", MetricType::Gauge);
    Add(&comms, static_cast<double>(engine_->NcclCommunicators()));
    out.push_back(std::move(comms));
    auto active = Family("kvcd_active_sequences", "Open decode sequences.", MetricType::Gauge);
    Add(&active, static_cast<double>(engine_->ActiveSequences()));
    out.push_back(std::move(active));
    auto budget = Family("kvcd_memory_budget_bytes", "The daemon's memory budget for page pools.",
                         MetricType::Gauge);
    Add(&budget, static_cast<double>(engine_->config().memory_budget_bytes));
    out.push_back(std::move(budget));
    // Per tenant (cache_salt), only with metrics_per_tenant (tenant names and their use on an
    // unauthenticated port: an operator's explicit choice, and only on loopback,
    // CheckMetricsExposure): only tenants with open sequences, pages in a pool, registered
    // models, decode channels or a configured quota, so the label's values stay bounded by
    // max_sequences, the pools' pages, the memory budget and the config.
    if (!engine_->config().metrics_per_tenant) return out;
    auto t_seqs = Family("kvcd_tenant_open_sequences", "Open sequences by tenant (cache_salt).",
                         MetricType::Gauge);
    auto t_pages =
        Family("kvcd_tenant_pinned_pages",
               "Pages held by a tenant's open sequences (prefix + own pages).", MetricType::Gauge);
    auto t_held = Family("kvcd_tenant_held_pages",
                         "Pages a tenant holds in all models' pools (cached pages it stored and "
                         "its sequences' own pages).",
                         MetricType::Gauge);
    auto t_models = Family("kvcd_tenant_registered_models",
                           "Models registered by RegisterModel under a tenant.", MetricType::Gauge);
    auto t_model_bytes = Family(
        "kvcd_tenant_registered_model_bytes",
        "Pool bytes (as allocated) of the models registered under a tenant.", MetricType::Gauge);
    auto t_prefix = Family("kvcd_tenant_pinned_prefix_pages",
                           "Pages held by a tenant's live prefix pins (summed over its pins).",
                           MetricType::Gauge);
    auto t_channels =
        Family("kvcd_tenant_open_decode_channels",
               "Decode channels open with a token that grants the tenant.", MetricType::Gauge);
    auto t_quota = Family("kvcd_tenant_quota",
                          "A tenant's quota by kind (max_sequences, max_pinned_pages, "
                          "max_lease_ms, max_models, max_model_bytes, max_pinned_prefix_pages, "
                          "max_decode_channels: 0 = no limit; max_memory_share: 1 = no limit).",
                          MetricType::Gauge);
    for (const TenantUsage& u : engine_->TenantUsages()) {
      Add(&t_seqs, static_cast<double>(u.open_sequences), {{"tenant", u.tenant}});
      Add(&t_pages, static_cast<double>(u.pinned_pages), {{"tenant", u.tenant}});
      Add(&t_quota, static_cast<double>(u.quota.max_sequences),
          {{"quota", "max_sequences"}, {"tenant", u.tenant}});
      Add(&t_quota, static_cast<double>(u.quota.max_pinned_pages),
          {{"quota", "max_pinned_pages"}, {"tenant", u.tenant}});
      Add(&t_quota, static_cast<double>(u.quota.max_lease_ms),
          {{"quota", "max_lease_ms"}, {"tenant", u.tenant}});
      Add(&t_quota, u.quota.max_memory_share,
          {{"quota", "max_memory_share"}, {"tenant", u.tenant}});
      Add(&t_quota, static_cast<double>(u.quota.max_models),
          {{"quota", "max_models"}, {"tenant", u.tenant}});
      Add(&t_quota, static_cast<double>(u.quota.max_model_bytes),
          {{"quota", "max_model_bytes"}, {"tenant", u.tenant}});
      Add(&t_quota, static_cast<double>(u.quota.max_pinned_prefix_pages),
          {{"quota", "max_pinned_prefix_pages"}, {"tenant", u.tenant}});
      Add(&t_prefix, static_cast<double>(u.pinned_prefix_pages), {{"tenant", u.tenant}});
      Add(&t_quota, static_cast<double>(u.quota.max_decode_channels),
          {{"quota", "max_decode_channels"}, {"tenant", u.tenant}});
      Add(&t_channels, static_cast<double>(u.open_decode_channels), {{"tenant", u.tenant}});
      Add(&t_held, static_cast<double>(u.held_pages), {{"tenant", u.tenant}});
      Add(&t_models, static_cast<double>(u.registered_models), {{"tenant", u.tenant}});
      Add(&t_model_bytes, static_cast<double>(u.registered_model_bytes), {{"tenant", u.tenant}});
    }
    out.push_back(std::move(t_seqs));
    out.push_back(std::move(t_pages));
    out.push_back(std::move(t_held));
    out.push_back(std::move(t_models));
    out.push_back(std::move(t_model_bytes));
    out.push_back(std::move(t_prefix));
    out.push_back(std::move(t_channels));
    out.push_back(std::move(t_quota));
    return out;
  }

 private:
  const CacheEngine* engine_;
};

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  // 10 us .. ~10 s, x2.5 per bucket.
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1e-5; v < 20; v *= 2.5) b.push_back(v);
  return b;
}

}  // namespace

Metrics::Metrics(const CacheEngine* engine, const BuildLabels& build)
    : registry_(std::make_shared<prometheus::Registry>()),
      cache_collector_(std::make_shared<CacheCollector>(engine)) {
  prometheus::BuildGauge()
      .Name("kvcd_build_info")
      .Help("The daemon's build: version, commit, serving backend, CUDA compiled in; value 1.")
      .Register(*registry_)
      .Add({{"version", build.version},
            {"commit", build.commit},
            {"backend", build.backend},
            {"cuda", build.cuda ? "true" : "false"}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("kvcd_process_start_time_seconds")
      .Help("When the daemon process started (Unix time, seconds); it changes on a restart.")
      .Register(*registry_)
      .Add({})
      .Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  rpc_seconds_ = &prometheus::BuildHistogram()
                      .Name("kvcd_rpc_duration_seconds")
                      .Help("Server-side latency of kvcd RPCs by method and status code.")
                      .Register(*registry_);
  kernel_seconds_ = &prometheus::BuildHistogram()
                         .Name("kvcd_attention_kernel_seconds")
                         .Help("Time inside the attention kernels per AttentionDecode batch.")
                         .Register(*registry_)
                         .Add({}, LatencyBuckets());
}

Metrics::~Metrics() = default;

absl::StatusOr<int> Metrics::Serve(const std::string& address) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on '", address, "': ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(cache_collector_);
  for (const auto& c : extra_) exposer_->RegisterCollectable(c);
  const auto ports = exposer_->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError("metrics exposer has no listening port");
  return ports.front();
}

void Metrics::ObserveRpc(const std::string& method, absl::StatusCode code, double seconds) {
  RpcHistogram(method, code)->Observe(seconds);
}

prometheus::Histogram* Metrics::RpcHistogram(const std::string& method, absl::StatusCode code) {
  return &rpc_seconds_->Add({{"method", method}, {"code", absl::StatusCodeToString(code)}},
                            LatencyBuckets());
}

void Metrics::ObserveKernel(double seconds) { kernel_seconds_->Observe(seconds); }

std::string Metrics::Render() const {
  auto families = registry_->Collect();
  auto cache = cache_collector_->Collect();
  families.insert(families.end(), cache.begin(), cache.end());
  for (const auto& c : extra_) {
    auto more = c->Collect();
    families.insert(families.end(), more.begin(), more.end());
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace kvcd
