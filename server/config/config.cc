#include "server/config/config.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/formats/format_registry.h"

namespace kvcd {
namespace {

absl::Status CheckKeys(const YAML::Node& node, const std::string& where,
                       const std::set<std::string>& allowed) {
  if (!node.IsMap()) return absl::InvalidArgumentError(absl::StrCat(where, " must be a mapping"));
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    if (!allowed.count(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown key '", where.empty() ? "" : where + ".", key,
                       "'; expected one of: ", absl::StrJoin(allowed, ", ")));
    }
  }
  return absl::OkStatus();
}

template <class T>
absl::Status Read(const YAML::Node& node, const std::string& key, const std::string& where,
                  T* out) {
  const YAML::Node v = node[key];
  if (!v) return absl::OkStatus();
  try {
    *out = v.as<T>();
  } catch (const YAML::Exception&) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, key, " has value '", v.Scalar(), "' of the wrong type"));
  }
  return absl::OkStatus();
}

absl::Status ReadBytes(const YAML::Node& node, const std::string& key, const std::string& where,
                       uint64_t* out) {
  const YAML::Node v = node[key];
  if (!v) return absl::OkStatus();
  if (!v.IsScalar()) return absl::InvalidArgumentError(absl::StrCat(where, key, " must be a size"));
  auto parsed = ParseByteSize(v.Scalar());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, key, ": ", parsed.status().message()));
  }
  *out = *parsed;
  return absl::OkStatus();
}

absl::Status ParseModel(const YAML::Node& m, int index, ModelSpec* spec) {
  const std::string where = absl::StrCat("models[", index, "].");
  KVCD_RETURN_IF_ERROR(
      CheckKeys(m, absl::StrCat("models[", index, "]"),
                {"builtin", "name", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                 "page_size", "sink_tokens", "recent_tokens", "history_format", "rope", "memory",
                 "bf16_fraction", "codec_file", "codec", "fsq_residual_width", "fsq_latent_width",
                 "key_norm", "key_norm_eps"}));
  if (m["builtin"]) {
    const std::string b = m["builtin"].as<std::string>();
    auto builtin = BuiltinModelSpec(b);
    if (!builtin) {
      return absl::InvalidArgumentError(absl::StrCat(where, "builtin is '", b,
                                                     "', expected one of ",
                                                     absl::StrJoin(BuiltinModelNames(), ", ")));
    }
    *spec = *builtin;
  }
  KVCD_RETURN_IF_ERROR(Read(m, "name", where, &spec->name));
  KVCD_RETURN_IF_ERROR(Read(m, "num_layers", where, &spec->num_layers));
  KVCD_RETURN_IF_ERROR(Read(m, "num_q_heads", where, &spec->num_q_heads));
  KVCD_RETURN_IF_ERROR(Read(m, "num_kv_heads", where, &spec->num_kv_heads));
  KVCD_RETURN_IF_ERROR(Read(m, "head_dim", where, &spec->head_dim));
  KVCD_RETURN_IF_ERROR(Read(m, "page_size", where, &spec->page_size));
  KVCD_RETURN_IF_ERROR(Read(m, "sink_tokens", where, &spec->sink_tokens));
  KVCD_RETURN_IF_ERROR(Read(m, "recent_tokens", where, &spec->recent_tokens));
  KVCD_RETURN_IF_ERROR(Read(m, "bf16_fraction", where, &spec->bf16_fraction));
  KVCD_RETURN_IF_ERROR(Read(m, "codec_file", where, &spec->codec_file));
  KVCD_RETURN_IF_ERROR(Read(m, "codec", where, &spec->codec));
  KVCD_RETURN_IF_ERROR(ReadBytes(m, "memory", where, &spec->memory_bytes));
  KVCD_RETURN_IF_ERROR(Read(m, "fsq_residual_width", where, &spec->fsq_residual_width));
  KVCD_RETURN_IF_ERROR(Read(m, "fsq_latent_width", where, &spec->fsq_latent_width));
  KVCD_RETURN_IF_ERROR(Read(m, "key_norm_eps", where, &spec->key_norm_eps));
  if (m["key_norm"]) {
    const std::string kn = m["key_norm"].as<std::string>();
    if (kn != "none" && kn != "rms") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "key_norm is '", kn.substr(0, 64), "', expected 'none' or 'rms'"));
    }
    spec->key_norm = kn == "rms";
  }
  if (m["history_format"]) {
    KVCD_RETURN_IF_ERROR(ParseFormatName(m["history_format"].as<std::string>(), "history_format",
                                         &spec->history_format));
  }
  if (const YAML::Node rope = m["rope"]) {
    const std::string rw = where + "rope.";
    KVCD_RETURN_IF_ERROR(
        CheckKeys(rope, where + "rope", {"theta", "rotary_dims", "scaling", "pairing"}));
    if (rope["pairing"]) {
      const std::string pairing = rope["pairing"].as<std::string>();
      if (pairing != "half" && pairing != "interleaved") {
        return absl::InvalidArgumentError(absl::StrCat(rw, "pairing is '", pairing.substr(0, 64),
                                                       "', expected 'half' or 'interleaved'"));
      }
      spec->rope_interleaved = pairing == "interleaved";
    }
    KVCD_RETURN_IF_ERROR(Read(rope, "theta", rw, &spec->rope_theta));
    KVCD_RETURN_IF_ERROR(Read(rope, "rotary_dims", rw, &spec->rope_rotary_dims));
    KVCD_RETURN_IF_ERROR(Read(rope, "scaling", rw, &spec->rope_scaling));
  }
  return ValidateModelSpec(*spec);
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(const std::string& s) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(s, &pos);
  } catch (...) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", s, "' is not a size; expected e.g. 1073741824, 512MiB, 2GiB"));
  }
  std::string unit = s.substr(pos);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  double mult = 1;
  if (unit.empty() || unit == "B") {
    mult = 1;
  } else if (unit == "KiB") {
    mult = 1024.0;
  } else if (unit == "MiB") {
    mult = 1024.0 * 1024;
  } else if (unit == "GiB") {
    mult = 1024.0 * 1024 * 1024;
  } else if (unit == "TiB") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else if (unit == "KB") {
    mult = 1e3;
  } else if (unit == "MB") {
    mult = 1e6;
  } else if (unit == "GB") {
    mult = 1e9;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unit '", unit, "' in '", s, "' is not one of B, KiB, MiB, GiB, TiB, KB, MB, GB"));
  }
  const double bytes = value * mult;
  if (!(bytes >= 0) || bytes > 9.0e18) {
    return absl::InvalidArgumentError(absl::StrCat("size '", s, "' is out of range"));
  }
  return static_cast<uint64_t>(std::llround(bytes));
}

absl::StatusOr<ServerConfig> ParseConfig(const std::string& yaml_text) {
  ServerConfig c;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config is not valid YAML: ", e.what()));
  }
  if (root.IsNull()) return c;
  try {
    KVCD_RETURN_IF_ERROR(CheckKeys(root, "",
                                   {"listen",
                                    "health_listen",
                                    "metrics_listen",
                                    "backend",
                                    "cuda_device",
                                    "memory_budget",
                                    "high_watermark",
                                    "low_watermark",
                                    "lease",
                                    "worker_threads",
                                    "compute_threads",
                                    "max_message_bytes",
                                    "max_sequences",
                                    "max_buffers",
                                    "decode_channel_spin_us",
                                    "drain_timeout_ms",
                                    "max_pin_ttl_ms",
                                    "metrics_per_tenant",
                                    "models",
                                    "tls",
                                    "auth",
                                    "quotas"}));
    KVCD_RETURN_IF_ERROR(Read(root, "listen", "", &c.listen));
    KVCD_RETURN_IF_ERROR(Read(root, "health_listen", "", &c.health_listen));
    KVCD_RETURN_IF_ERROR(Read(root, "metrics_listen", "", &c.metrics_listen));
    KVCD_RETURN_IF_ERROR(Read(root, "metrics_per_tenant", "", &c.metrics_per_tenant));
    KVCD_RETURN_IF_ERROR(Read(root, "backend", "", &c.backend));
    KVCD_RETURN_IF_ERROR(Read(root, "cuda_device", "", &c.cuda_device));
    KVCD_RETURN_IF_ERROR(ReadBytes(root, "memory_budget", "", &c.memory_budget_bytes));
    KVCD_RETURN_IF_ERROR(Read(root, "high_watermark", "", &c.high_watermark));
    KVCD_RETURN_IF_ERROR(Read(root, "low_watermark", "", &c.low_watermark));
    KVCD_RETURN_IF_ERROR(Read(root, "worker_threads", "", &c.worker_threads));
    KVCD_RETURN_IF_ERROR(Read(root, "compute_threads", "", &c.compute_threads));
    KVCD_RETURN_IF_ERROR(Read(root, "max_message_bytes", "", &c.max_message_bytes));
    KVCD_RETURN_IF_ERROR(Read(root, "max_sequences", "", &c.max_sequences));
    KVCD_RETURN_IF_ERROR(Read(root, "max_buffers", "", &c.max_buffers));
    KVCD_RETURN_IF_ERROR(Read(root, "decode_channel_spin_us", "", &c.decode_channel_spin_us));
    KVCD_RETURN_IF_ERROR(Read(root, "drain_timeout_ms", "", &c.drain_timeout_ms));
    KVCD_RETURN_IF_ERROR(Read(root, "max_pin_ttl_ms", "", &c.max_pin_ttl_ms));
    if (const YAML::Node lease = root["lease"]) {
      KVCD_RETURN_IF_ERROR(CheckKeys(lease, "lease", {"default_ms", "max_ms"}));
      KVCD_RETURN_IF_ERROR(Read(lease, "default_ms", "lease.", &c.default_lease_ms));
      KVCD_RETURN_IF_ERROR(Read(lease, "max_ms", "lease.", &c.max_lease_ms));
    }
    if (const YAML::Node tls = root["tls"]) {
      KVCD_RETURN_IF_ERROR(
          CheckKeys(tls, "tls", {"cert_file", "key_file", "client_ca_file", "reload_interval_s"}));
      KVCD_RETURN_IF_ERROR(Read(tls, "cert_file", "tls.", &c.tls.cert_file));
      KVCD_RETURN_IF_ERROR(Read(tls, "key_file", "tls.", &c.tls.key_file));
      KVCD_RETURN_IF_ERROR(Read(tls, "client_ca_file", "tls.", &c.tls.client_ca_file));
      KVCD_RETURN_IF_ERROR(Read(tls, "reload_interval_s", "tls.", &c.tls.reload_interval_s));
    }
    if (const YAML::Node auth = root["auth"]) {
      KVCD_RETURN_IF_ERROR(CheckKeys(auth, "auth", {"tokens_file", "reload_interval_ms"}));
      KVCD_RETURN_IF_ERROR(Read(auth, "tokens_file", "auth.", &c.auth.tokens_file));
      KVCD_RETURN_IF_ERROR(Read(auth, "reload_interval_ms", "auth.", &c.auth.reload_interval_ms));
    }
    if (const YAML::Node quotas = root["quotas"]) {
      KVCD_RETURN_IF_ERROR(CheckKeys(quotas, "quotas", {"default", "tenants"}));
      auto read_quota = [&](const YAML::Node& n, const std::string& where,
                            TenantQuota* q) -> absl::Status {
        KVCD_RETURN_IF_ERROR(CheckKeys(
            n, where,
            {"tenant", "max_sequences", "max_pinned_pages", "max_lease_ms", "max_memory_share",
             "max_models", "max_model_bytes", "max_pinned_prefix_pages", "max_decode_channels"}));
        const std::string prefix = where + ".";
        KVCD_RETURN_IF_ERROR(Read(n, "max_sequences", prefix, &q->max_sequences));
        KVCD_RETURN_IF_ERROR(Read(n, "max_pinned_pages", prefix, &q->max_pinned_pages));
        KVCD_RETURN_IF_ERROR(Read(n, "max_lease_ms", prefix, &q->max_lease_ms));
        KVCD_RETURN_IF_ERROR(Read(n, "max_memory_share", prefix, &q->max_memory_share));
        KVCD_RETURN_IF_ERROR(Read(n, "max_models", prefix, &q->max_models));
        KVCD_RETURN_IF_ERROR(ReadBytes(n, "max_model_bytes", prefix, &q->max_model_bytes));
        KVCD_RETURN_IF_ERROR(
            Read(n, "max_pinned_prefix_pages", prefix, &q->max_pinned_prefix_pages));
        KVCD_RETURN_IF_ERROR(Read(n, "max_decode_channels", prefix, &q->max_decode_channels));
        if (q->max_sequences < 0 || q->max_pinned_pages < 0 || q->max_lease_ms < 0 ||
            q->max_models < 0 || q->max_pinned_prefix_pages < 0 || q->max_decode_channels < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": quotas must be >= 0 (0 = no limit)"));
        }
        if (!(q->max_memory_share > 0 && q->max_memory_share <= 1)) {  // NaN fails too
          return absl::InvalidArgumentError(
              absl::StrCat(where, ".max_memory_share is ", q->max_memory_share,
                           ", expected a fraction of each model's page pools in (0, 1] "
                           "(1 = no limit)"));
        }
        if (q->max_lease_ms != 0 && q->max_lease_ms < 10) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ".max_lease_ms is ", q->max_lease_ms, ", expected 0 or >= 10"));
        }
        return absl::OkStatus();
      };
      if (const YAML::Node d = quotas["default"]) {
        KVCD_RETURN_IF_ERROR(read_quota(d, "quotas.default", &c.quotas.defaults));
      }
      if (const YAML::Node tenants = quotas["tenants"]) {
        if (!tenants.IsSequence()) {
          return absl::InvalidArgumentError(
              "quotas.tenants must be a list of {tenant: <cache_salt>, max_...: N}");
        }
        for (size_t i = 0; i < tenants.size(); ++i) {
          const std::string where = absl::StrCat("quotas.tenants[", i, "]");
          if (!tenants[i]["tenant"]) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ".tenant is missing (the tenant's cache_salt)"));
          }
          const std::string name = tenants[i]["tenant"].as<std::string>();
          TenantQuota q = c.quotas.defaults;  // keys not given: the defaults
          KVCD_RETURN_IF_ERROR(read_quota(tenants[i], where, &q));
          if (!c.quotas.tenants.emplace(name, q).second) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ": tenant '", name, "' appears twice"));
          }
        }
      }
    }
    if (const YAML::Node models = root["models"]) {
      if (!models.IsSequence()) return absl::InvalidArgumentError("models must be a list");
      for (size_t i = 0; i < models.size(); ++i) {
        ModelSpec spec;
        KVCD_RETURN_IF_ERROR(ParseModel(models[i], static_cast<int>(i), &spec));
        c.models.push_back(spec);
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", e.what()));
  }
  if (c.listen.empty()) return absl::InvalidArgumentError("listen must be host:port");
  if (c.cuda_device < 0 || c.cuda_device > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_device is ", c.cuda_device, ", expected a device ordinal 0..64"));
  }
  if (c.backend != "cpu" && c.backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend is '", c.backend, "', expected 'cpu' or 'cuda'"));
  }
  if (!(c.low_watermark > 0 && c.low_watermark < c.high_watermark && c.high_watermark <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("watermarks must satisfy 0 < low_watermark < high_watermark <= 1; got low ",
                     c.low_watermark, ", high ", c.high_watermark));
  }
  if (c.default_lease_ms < 10 || c.max_lease_ms < c.default_lease_ms) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease.default_ms must be >= 10 and lease.max_ms >= lease.default_ms; got ",
                     c.default_lease_ms, " and ", c.max_lease_ms));
  }
  if (c.max_pin_ttl_ms < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_pin_ttl_ms is ", c.max_pin_ttl_ms,
        ", expected >= 1 (the longest ttl_ms of a PinPrefix, in ms; default 86400000 = 24 h)"));
  }
  if (c.worker_threads < 0 || c.worker_threads > 1024 || c.compute_threads < 0 ||
      c.compute_threads > 1024) {
    return absl::InvalidArgumentError("worker_threads and compute_threads must be in 0..1024");
  }
  if (c.max_message_bytes < (1 << 20) || c.max_message_bytes > (2047ll << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes is ", c.max_message_bytes, ", expected 1MiB..2047MiB"));
  }
  if (c.max_sequences < 1) return absl::InvalidArgumentError("max_sequences must be >= 1");
  if (c.decode_channel_spin_us < 0 || c.decode_channel_spin_us > 1000000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode_channel_spin_us is ", c.decode_channel_spin_us, ", expected 0..1000000"));
  }
  if (c.max_buffers < 1 || c.max_buffers > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_buffers is ", c.max_buffers, ", expected 1..65536"));
  }
  if (c.tls.cert_file.empty() != c.tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls.cert_file and tls.key_file go together: set both (PEM certificate chain and its "
        "private key) or neither");
  }
  if (!c.tls.client_ca_file.empty() && c.tls.cert_file.empty()) {
    return absl::InvalidArgumentError(
        "tls.client_ca_file (mutual TLS) needs tls.cert_file and tls.key_file as well");
  }
  if (c.tls.reload_interval_s < 1 || c.tls.reload_interval_s > 86400) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls.reload_interval_s is ", c.tls.reload_interval_s, ", expected 1..86400"));
  }
  if (c.auth.reload_interval_ms < 10 || c.auth.reload_interval_ms > 86400000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "auth.reload_interval_ms is ", c.auth.reload_interval_ms, ", expected 10..86400000"));
  }
  uint64_t total = 0;
  std::set<std::string> names;
  for (const auto& m : c.models) {
    if (!names.insert(m.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("models: name '", m.name, "' appears twice"));
    }
    total += m.memory_bytes;
  }
  if (total > c.memory_budget_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("models ask for ", total,
                                                   " bytes in all, more than memory_budget (",
                                                   c.memory_budget_bytes, ")"));
  }
  return c;
}

namespace {

bool IsLoopbackSockaddr(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr) >> 24) == 127;
  }
  if (a->sa_family == AF_INET6) {
    const in6_addr& v6 = reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return false;
}

}  // namespace

bool IsLoopbackAddress(const std::string& address) {
  if (address.rfind("unix:", 0) == 0 || address.rfind("unix-abstract:", 0) == 0) return true;
  std::string host = address;
  const auto colon = host.rfind(':');
  if (colon != std::string::npos && host.find(']') == std::string::npos &&
      host.find(':') == colon) {
    host = host.substr(0, colon);  // host:port
  } else if (!host.empty() && host[0] == '[') {
    host = host.substr(1, host.find(']') - 1);  // [v6]:port
  }
  if (host.empty()) return false;  // ":port": every interface
  // A host is judged by the addresses it resolves to (a literal resolves to itself), all of
  // which must be loopback; never by its spelling ("127.attacker.example" is a DNS name).
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool all = found != nullptr;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    all = all && a->ai_addr != nullptr && IsLoopbackSockaddr(a->ai_addr);
  }
  freeaddrinfo(found);
  return all;
}

absl::Status CheckExposure(const ServerConfig& c) {
  if (IsLoopbackAddress(c.listen) || c.insecure) return absl::OkStatus();
  if (c.tls.enabled() && c.auth.enabled()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to serve on non-loopback address '", c.listen, "' without ",
      !c.tls.enabled() && !c.auth.enabled() ? "TLS and authentication"
      : !c.tls.enabled()                    ? "TLS"
                                            : "authentication",
      ": set tls.cert_file and tls.key_file (and tls.client_ca_file for mutual TLS) and "
      "auth.tokens_file in the config (docs/operating.md, \"Security\"), listen on 127.0.0.1, or "
      "start with 'kvcd serve --insecure' to serve this address unprotected"));
}

absl::Status CheckMetricsExposure(const ServerConfig& c) {
  if (!c.metrics_per_tenant || c.metrics_listen.empty() || IsLoopbackAddress(c.metrics_listen)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing metrics_per_tenant: true with metrics_listen '", c.metrics_listen,
      "' beyond loopback: the metrics port is plaintext and unauthenticated, and the "
      "kvcd_tenant_* metrics name every tenant and its use; set metrics_per_tenant: false, or "
      "listen for metrics on 127.0.0.1 (docs/operating.md, \"Metrics\")"));
}

absl::StatusOr<ServerConfig> LoadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = ParseConfig(ss.str());
  if (!c.ok())
    return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

absl::Status CheckModelCodecs(const ServerConfig& c) {
  for (const ModelSpec& m : c.models) {
    KVCD_RETURN_IF_ERROR(LoadModelCodec(m, /*codec_blob=*/"").status());
  }
  return absl::OkStatus();
}

}  // namespace kvcd
