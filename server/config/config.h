// Daemon configuration (YAML). Every field is validated; unknown keys are errors, so
// a typo never silently falls back to a default. See docs/operating.md "Configuration".
// The keys, their types and ranges are those of kvcd-config.schema.json beside this file
// (config_schema.h), which the Helm chart's values schema is derived from.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/formats/model_spec.h"

namespace kvcd {

// TLS on the gRPC API port (the health-only port stays plaintext). With client_ca_file
// set it is mutual TLS: clients must present a certificate signed by that CA.
struct TlsConfig {
  std::string cert_file;       // PEM certificate chain of the daemon
  std::string key_file;        // PEM private key of cert_file
  std::string client_ca_file;  // optional PEM CA bundle: require and verify client certs
  int reload_interval_s = 10;  // how often the files are checked for changes
  bool enabled() const { return !cert_file.empty(); }
};

// Bearer-token authentication (server/rpc/auth.h describes the tokens file).
struct AuthConfig {
  std::string tokens_file;
  int64_t reload_interval_ms = 1000;  // how often the file is checked for changes
  bool enabled() const { return !tokens_file.empty(); }
};

// Fair sharing between tenants. The tenant of a request is its cache_salt (RegisterModel:
// its `tenant` field): with auth on, the token must grant that tenant (authorizer.h), so the
// quota is the authenticated tenant's; with auth off it is whatever the client sends
// (cooperative sharing only: nothing stops a client from using many salts). 0 = no limit of
// that kind.
struct TenantQuota {
  int64_t max_sequences = 0;     // open sequences
  int64_t max_pinned_pages = 0;  // pages held by its open sequences (prefix + own pages)
  int64_t max_lease_ms = 0;      // longer leases are granted this long
  // The fraction of each page pool of each model that the tenant's pages may take (cached
  // prefix pages it stored and its sequences' own pages): at most floor(share * pages of
  // the pool). A tenant at its share that needs pages evicts only its own. In (0, 1];
  // 1 = no limit.
  double max_memory_share = 1.0;
  int64_t max_models = 0;        // models registered by RegisterModel under this tenant
  uint64_t max_model_bytes = 0;  // pool bytes (as allocated) of the models it registered
  // Pages its live PinPrefix pins hold, summed over its pins (a page under two of its pins
  // counts twice).
  int64_t max_pinned_prefix_pages = 0;
  // Decode channels open at once with a token that grants the tenant (a channel counts once
  // against each tenant its token grants; auth off or a "*" token: the default tenant "").
  int64_t max_decode_channels = 0;
};

struct TenantQuotaConfig {
  TenantQuota defaults;                        // every tenant not listed below
  std::map<std::string, TenantQuota> tenants;  // per tenant (cache_salt); unset keys: defaults
  const TenantQuota& For(const std::string& tenant) const {
    auto it = tenants.find(tenant);
    return it == tenants.end() ? defaults : it->second;
  }
};

// Several daemons as one prefix cache (docs/cluster.md). `present` is false when the config
// has no cluster: section (a lone daemon).
struct ClusterConfig {
  bool present = false;
  std::string name = "kvcd";        // etcd prefix /kvcd/<name>, Redis hash tag {<name>}
  std::string member_id;            // empty in the file: the hostname (filled by ParseConfig)
  std::string membership = "none";  // etcd | dns | none
  std::vector<std::string> etcd_endpoints;  // host:port
  int lease_ttl_s = 10;
  std::string dns_name;
  std::string redis_url;  // redis://host:port, or empty (no block index)
  int64_t load_interval_ms = 500;
  std::string events_endpoint;         // tcp://host:port, or empty
  std::string events_replay_endpoint;  // tcp://host:port, or empty
  int events_buffer = 10000;
  std::string advertise_address;  // host:port; empty: listen
  // A file holding the bearer token this daemon presents on its own calls to peers that are
  // not made for a client (DNS membership's Stats). Needed with membership dns and auth on;
  // re-read every round, so a rotated secret is picked up.
  std::string peer_token_file;
  // PullPrefix's transport: grpc | auto | cuda_ipc | nccl (docs/cluster.md "Transports");
  // the device transports are opt-in until a device run has verified them.
  std::string pull_transport = "grpc";
  bool has_peers() const { return present && membership != "none"; }
  // The etcd key prefix of the members: /kvcd/<name>/members/.
  std::string MembersPrefix() const { return "/kvcd/" + name + "/members/"; }
};

// Splits "redis://host:port" (port default 6379); INVALID_ARGUMENT otherwise.
absl::Status ParseRedisUrl(const std::string& url, std::string* host, int* port);

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";  // gRPC address; port 0 = pick a free port
  std::string health_listen;               // optional extra plaintext port serving health only
  std::string metrics_listen = "127.0.0.1:9464";  // Prometheus exposer; "" disables
  // The kvcd_tenant_* metrics (tenant names and their use as labels): off unless asked
  // for, and refused when metrics_listen is beyond loopback (CheckMetricsExposure).
  bool metrics_per_tenant = false;
  std::string backend = "cpu";                // "cpu" (or "cuda" when built with CUDA)
  int cuda_device = 0;                        // device ordinal of the cuda backend
  uint64_t memory_budget_bytes = 1ull << 30;  // total for all model pools
  double high_watermark = 0.95;               // evict when a pool is fuller than this ...
  double low_watermark = 0.85;                // ... down to this
  int64_t default_lease_ms = 30000;
  int64_t max_lease_ms = 600000;
  int worker_threads = 0;   // request executor threads (0 = number of CPUs)
  int compute_threads = 0;  // attention threads (0 = number of CPUs)
  int64_t max_message_bytes = 256ll << 20;
  int max_sequences = 4096;
  int max_buffers = 256;  // CUDA IPC buffers registered at once
  // A decode channel's thread spins this long after each request before it polls.
  int64_t decode_channel_spin_us = 2000;
  int64_t drain_timeout_ms = 10000;
  // The longest ttl_ms a PinPrefix may ask for (>= 1; default 24 h).
  int64_t max_pin_ttl_ms = 24ll * 3600 * 1000;
  std::vector<ModelSpec> models;
  TenantQuotaConfig quotas;
  TlsConfig tls;
  AuthConfig auth;
  ClusterConfig cluster;
  // Set only by `kvcd serve --insecure`: allow a non-loopback listen address without
  // TLS and auth. Never read from a config file.
  bool insecure = false;
  // Set only by `kvcd serve --fault-inject SPEC` (tests): make the backend fail on purpose
  // (server/backends/fault_injector.h). Never read from a config file.
  std::string fault_inject;
};

// The start-up safety rule: a non-loopback `listen` needs TLS and auth, unless
// `insecure`. FAILED_PRECONDITION says how to configure them.
absl::Status CheckExposure(const ServerConfig& c);
// metrics_per_tenant puts tenant names on the unauthenticated metrics port: only on
// loopback (IsLoopbackAddress). FAILED_PRECONDITION says what to change.
absl::Status CheckMetricsExposure(const ServerConfig& c);
// True for unix: addresses and for a host:port whose host resolves only to loopback
// addresses (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104): an IP literal, localhost, or a name
// that points there. Decided by the resolved addresses, not the spelling of the name.
bool IsLoopbackAddress(const std::string& host_port);

// Parses and validates a YAML document: against the schema (keys, types, ranges), then
// what the schema cannot say (one key against another, model geometry, the memory budget).
// A key the schema accepts that this code does not read yet (one marked x-kvcd-status "in
// progress" there) is refused, never ignored. INVALID_ARGUMENT names the key and the
// expected value.
absl::StatusOr<ServerConfig> ParseConfig(const std::string& yaml_text);
// Reads and parses a file (NOT_FOUND if it cannot be read).
absl::StatusOr<ServerConfig> LoadConfigFile(const std::string& path);

// Opens and checks every model's codec file (codec_file) as `kvcd serve` does when it
// registers the model: through its history format's factory (LoadModelCodec). The first
// error: INVALID_ARGUMENT naming the model and the codec_file.
absl::Status CheckModelCodecs(const ServerConfig& c);

// Parses "1073741824", "512MiB", "2GiB", "1.5GB" into bytes.
absl::StatusOr<uint64_t> ParseByteSize(const std::string& s);

}  // namespace kvcd
