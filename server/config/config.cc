#include "server/config/config.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/config/config_schema.h"
#include "server/formats/format_registry.h"

namespace kvcd {
namespace {

using nlohmann::json;

// The YAML document as JSON, for the schema: plain scalars resolve as YAML 1.2's core schema
// does (null, true/false, integers, floats, else strings); quoted scalars are strings.
class YamlToJson {
 public:
  absl::StatusOr<json> Convert(const YAML::Node& n, const std::string& path, int depth) {
    if (--budget_ < 0) return absl::InvalidArgumentError("config has more than 100000 nodes");
    if (depth > 64) return absl::InvalidArgumentError(absl::StrCat(path, " is nested too deeply"));
    switch (n.Type()) {
      case YAML::NodeType::Map: {
        json out = json::object();
        for (const auto& kv : n) {
          if (!kv.first.IsScalar()) {
            return absl::InvalidArgumentError(
                absl::StrCat(path.empty() ? "the config" : path, " has a key that is not a name"));
          }
          const std::string key = kv.first.Scalar();
          KVCD_ASSIGN_OR_RETURN(
              out[key], Convert(kv.second, path.empty() ? key : path + "." + key, depth + 1));
        }
        return out;
      }
      case YAML::NodeType::Sequence: {
        json out = json::array();
        for (size_t i = 0; i < n.size(); ++i) {
          KVCD_ASSIGN_OR_RETURN(json item,
                                Convert(n[i], absl::StrCat(path, "[", i, "]"), depth + 1));
          out.push_back(std::move(item));
        }
        return out;
      }
      case YAML::NodeType::Scalar:
        return n.Tag() == "?" ? Plain(n.Scalar()) : json(n.Scalar());
      default:
        return json(nullptr);
    }
  }

 private:
  static json Plain(const std::string& s) {
    static const std::regex kInt("[-+]?[0-9]+");
    static const std::regex kFloat("[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?");
    if (s == "true" || s == "True" || s == "TRUE") return true;
    if (s == "false" || s == "False" || s == "FALSE") return false;
    if (s.size() > 64) return s;
    if (std::regex_match(s, kInt)) {
      errno = 0;
      const long long v = std::strtoll(s.c_str(), nullptr, 10);
      if (errno == 0) return v;
      return std::strtod(s.c_str(), nullptr);  // out of range: a number no integer key takes
    }
    if (std::regex_match(s, kFloat)) return std::strtod(s.c_str(), nullptr);
    if (s == ".nan" || s == ".NaN" || s == ".NAN") return std::nan("");
    static const std::regex kInf("[-+]?\\.(inf|Inf|INF)");
    if (std::regex_match(s, kInf)) return s[0] == '-' ? -HUGE_VAL : HUGE_VAL;
    return s;
  }

  int budget_ = 100000;
};

// Reads the keys of a document the schema accepted into the config, and remembers which it
// read: a key the schema accepts but no code reads (one added to the schema before the
// daemon implements it) is refused by CheckAllRead instead of being ignored.
class Reader {
 public:
  template <class T>
  absl::Status Read(const YAML::Node& node, const std::string& key, const std::string& where,
                    T* out) {
    const YAML::Node v = node[key];
    if (!v) return absl::OkStatus();
    read_.insert(where + key);
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
    read_.insert(where + key);
    if (!v.IsScalar()) {
      return absl::InvalidArgumentError(absl::StrCat(where, key, " must be a size"));
    }
    auto parsed = ParseByteSize(v.Scalar());
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where, key, ": ", parsed.status().message()));
    }
    *out = *parsed;
    return absl::OkStatus();
  }

  // For keys read element by element (lists of scalars).
  void Mark(const std::string& path) { read_.insert(path); }

  // For keys read without Read (enumerations, names).
  std::string Take(const YAML::Node& node, const std::string& key, const std::string& where) {
    read_.insert(where + key);
    return node[key].as<std::string>();
  }

  // Every scalar of the document was read; else INVALID_ARGUMENT naming the first that was not.
  absl::Status CheckAllRead(const YAML::Node& n, const std::string& path) const {
    if (n.IsMap()) {
      for (const auto& kv : n) {
        const std::string key = kv.first.Scalar();
        KVCD_RETURN_IF_ERROR(CheckAllRead(kv.second, path.empty() ? key : path + "." + key));
      }
    } else if (n.IsSequence()) {
      for (size_t i = 0; i < n.size(); ++i) {
        KVCD_RETURN_IF_ERROR(CheckAllRead(n[i], absl::StrCat(path, "[", i, "]")));
      }
    } else if (!read_.count(path)) {
      return absl::InvalidArgumentError(
          absl::StrCat("key '", path,
                       "' is in the config schema but this kvcd does not implement it yet (see its "
                       "x-kvcd-status in server/config/kvcd-config.schema.json)"));
    }
    return absl::OkStatus();
  }

 private:
  std::set<std::string> read_;
};

absl::Status ReadModel(Reader& r, const YAML::Node& m, int index, ModelSpec* spec) {
  const std::string where = absl::StrCat("models[", index, "].");
  if (m["builtin"]) {
    const std::string b = r.Take(m, "builtin", where);
    auto builtin = BuiltinModelSpec(b);
    if (!builtin) {
      return absl::InvalidArgumentError(absl::StrCat(where, "builtin is '", b,
                                                     "', expected one of ",
                                                     absl::StrJoin(BuiltinModelNames(), ", ")));
    }
    *spec = *builtin;
  }
  KVCD_RETURN_IF_ERROR(r.Read(m, "name", where, &spec->name));
  KVCD_RETURN_IF_ERROR(r.Read(m, "num_layers", where, &spec->num_layers));
  KVCD_RETURN_IF_ERROR(r.Read(m, "num_q_heads", where, &spec->num_q_heads));
  KVCD_RETURN_IF_ERROR(r.Read(m, "num_kv_heads", where, &spec->num_kv_heads));
  KVCD_RETURN_IF_ERROR(r.Read(m, "head_dim", where, &spec->head_dim));
  KVCD_RETURN_IF_ERROR(r.Read(m, "page_size", where, &spec->page_size));
  KVCD_RETURN_IF_ERROR(r.Read(m, "sink_tokens", where, &spec->sink_tokens));
  KVCD_RETURN_IF_ERROR(r.Read(m, "recent_tokens", where, &spec->recent_tokens));
  KVCD_RETURN_IF_ERROR(r.Read(m, "bf16_fraction", where, &spec->bf16_fraction));
  KVCD_RETURN_IF_ERROR(r.Read(m, "codec_file", where, &spec->codec_file));
  KVCD_RETURN_IF_ERROR(r.Read(m, "codec", where, &spec->codec));
  KVCD_RETURN_IF_ERROR(r.ReadBytes(m, "memory", where, &spec->memory_bytes));
  KVCD_RETURN_IF_ERROR(r.Read(m, "fsq_residual_width", where, &spec->fsq_residual_width));
  KVCD_RETURN_IF_ERROR(r.Read(m, "fsq_latent_width", where, &spec->fsq_latent_width));
  KVCD_RETURN_IF_ERROR(r.Read(m, "key_norm_eps", where, &spec->key_norm_eps));
  if (m["key_norm"]) spec->key_norm = r.Take(m, "key_norm", where) == "rms";  // schema: none|rms
  if (m["history_format"]) {
    KVCD_RETURN_IF_ERROR(ParseFormatName(r.Take(m, "history_format", where), "history_format",
                                         &spec->history_format));
  }
  if (const YAML::Node rope = m["rope"]) {
    const std::string rw = where + "rope.";
    if (rope["pairing"]) {  // schema: half|interleaved
      spec->rope_interleaved = r.Take(rope, "pairing", rw) == "interleaved";
    }
    KVCD_RETURN_IF_ERROR(r.Read(rope, "theta", rw, &spec->rope_theta));
    KVCD_RETURN_IF_ERROR(r.Read(rope, "rotary_dims", rw, &spec->rope_rotary_dims));
    KVCD_RETURN_IF_ERROR(r.Read(rope, "scaling", rw, &spec->rope_scaling));
  }
  return absl::OkStatus();
}

absl::Status ReadQuota(Reader& r, const YAML::Node& n, const std::string& where, TenantQuota* q) {
  const std::string prefix = where + ".";
  KVCD_RETURN_IF_ERROR(r.Read(n, "max_sequences", prefix, &q->max_sequences));
  KVCD_RETURN_IF_ERROR(r.Read(n, "max_pinned_pages", prefix, &q->max_pinned_pages));
  KVCD_RETURN_IF_ERROR(r.Read(n, "max_lease_ms", prefix, &q->max_lease_ms));
  KVCD_RETURN_IF_ERROR(r.Read(n, "max_memory_share", prefix, &q->max_memory_share));
  KVCD_RETURN_IF_ERROR(r.Read(n, "max_models", prefix, &q->max_models));
  KVCD_RETURN_IF_ERROR(r.ReadBytes(n, "max_model_bytes", prefix, &q->max_model_bytes));
  KVCD_RETURN_IF_ERROR(r.Read(n, "max_pinned_prefix_pages", prefix, &q->max_pinned_prefix_pages));
  KVCD_RETURN_IF_ERROR(r.Read(n, "max_decode_channels", prefix, &q->max_decode_channels));
  // The schema bounds each key (>= 0, max_memory_share in (0, 1]).
  if (q->max_lease_ms != 0 && q->max_lease_ms < 10) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".max_lease_ms is ", q->max_lease_ms, ", expected 0 or >= 10"));
  }
  return absl::OkStatus();
}

// The cluster: keys against each other; fills the member id's default (the hostname).
absl::Status CheckClusterConfig(ClusterConfig* k) {
  if (!k->present) return absl::OkStatus();
  if (k->membership == "etcd" && k->etcd_endpoints.empty()) {
    return absl::InvalidArgumentError(
        "cluster.membership is etcd but cluster.etcd_endpoints is empty: list the etcd v3 "
        "endpoints as host:port");
  }
  if (k->membership == "dns" && k->dns_name.empty()) {
    return absl::InvalidArgumentError(
        "cluster.membership is dns but cluster.dns_name is empty: name the headless Service "
        "whose A records are the members");
  }
  if (!k->redis_url.empty()) {
    std::string host;
    int port = 0;
    KVCD_RETURN_IF_ERROR(ParseRedisUrl(k->redis_url, &host, &port));
    if (k->membership == "none") {
      return absl::InvalidArgumentError(
          "cluster.redis_url needs cluster.membership etcd or dns: readers fence the index by "
          "the incarnation membership publishes");
    }
  }
  if (!k->events_replay_endpoint.empty() && k->events_endpoint.empty()) {
    return absl::InvalidArgumentError(
        "cluster.events_replay_endpoint needs cluster.events_endpoint (it replays that "
        "publisher's batches)");
  }
  if (k->member_id.empty()) {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
      return absl::InvalidArgumentError(
          "cluster.member_id is empty and the hostname cannot be read: set cluster.member_id");
    }
    k->member_id = host;
    static const std::regex kId("[A-Za-z0-9._-]{1,128}");
    if (!std::regex_match(k->member_id, kId)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster.member_id is empty and the hostname '", k->member_id,
          "' is not a valid member id (letters, digits, . _ -): set cluster.member_id"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseRedisUrl(const std::string& url, std::string* host, int* port) {
  static const std::regex kUrl("redis://([A-Za-z0-9._-]+|\\[[0-9A-Fa-f:.]+\\])(:([0-9]{1,5}))?/?");
  std::smatch m;
  if (!std::regex_match(url, m, kUrl)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster.redis_url is '", url,
                     "', expected redis://host:port (e.g. redis://127.0.0.1:6379)"));
  }
  std::string h = m[1].str();
  if (h.size() >= 2 && h.front() == '[') h = h.substr(1, h.size() - 2);
  const int p = m[3].matched ? std::stoi(m[3].str()) : 6379;
  if (p < 1 || p > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster.redis_url: port ", p, " is out of range 1..65535"));
  }
  *host = h;
  *port = p;
  return absl::OkStatus();
}

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
    // 1. Structure: keys, types and ranges, from the schema.
    KVCD_ASSIGN_OR_RETURN(const json doc, YamlToJson().Convert(root, "", 0));
    KVCD_RETURN_IF_ERROR(ValidateJson(doc, ConfigSchema()));
    // 2. Values.
    Reader r;
    KVCD_RETURN_IF_ERROR(r.Read(root, "listen", "", &c.listen));
    KVCD_RETURN_IF_ERROR(r.Read(root, "health_listen", "", &c.health_listen));
    KVCD_RETURN_IF_ERROR(r.Read(root, "metrics_listen", "", &c.metrics_listen));
    KVCD_RETURN_IF_ERROR(r.Read(root, "metrics_per_tenant", "", &c.metrics_per_tenant));
    KVCD_RETURN_IF_ERROR(r.Read(root, "backend", "", &c.backend));
    KVCD_RETURN_IF_ERROR(r.Read(root, "cuda_device", "", &c.cuda_device));
    KVCD_RETURN_IF_ERROR(r.ReadBytes(root, "memory_budget", "", &c.memory_budget_bytes));
    KVCD_RETURN_IF_ERROR(r.Read(root, "high_watermark", "", &c.high_watermark));
    KVCD_RETURN_IF_ERROR(r.Read(root, "low_watermark", "", &c.low_watermark));
    KVCD_RETURN_IF_ERROR(r.Read(root, "worker_threads", "", &c.worker_threads));
    KVCD_RETURN_IF_ERROR(r.Read(root, "compute_threads", "", &c.compute_threads));
    KVCD_RETURN_IF_ERROR(r.Read(root, "max_message_bytes", "", &c.max_message_bytes));
    KVCD_RETURN_IF_ERROR(r.Read(root, "max_sequences", "", &c.max_sequences));
    KVCD_RETURN_IF_ERROR(r.Read(root, "max_buffers", "", &c.max_buffers));
    KVCD_RETURN_IF_ERROR(r.Read(root, "decode_channel_spin_us", "", &c.decode_channel_spin_us));
    KVCD_RETURN_IF_ERROR(r.Read(root, "drain_timeout_ms", "", &c.drain_timeout_ms));
    KVCD_RETURN_IF_ERROR(r.Read(root, "max_pin_ttl_ms", "", &c.max_pin_ttl_ms));
    if (const YAML::Node lease = root["lease"]) {
      KVCD_RETURN_IF_ERROR(r.Read(lease, "default_ms", "lease.", &c.default_lease_ms));
      KVCD_RETURN_IF_ERROR(r.Read(lease, "max_ms", "lease.", &c.max_lease_ms));
    }
    if (const YAML::Node tls = root["tls"]) {
      KVCD_RETURN_IF_ERROR(r.Read(tls, "cert_file", "tls.", &c.tls.cert_file));
      KVCD_RETURN_IF_ERROR(r.Read(tls, "key_file", "tls.", &c.tls.key_file));
      KVCD_RETURN_IF_ERROR(r.Read(tls, "client_ca_file", "tls.", &c.tls.client_ca_file));
      KVCD_RETURN_IF_ERROR(r.Read(tls, "reload_interval_s", "tls.", &c.tls.reload_interval_s));
    }
    if (const YAML::Node auth = root["auth"]) {
      KVCD_RETURN_IF_ERROR(r.Read(auth, "tokens_file", "auth.", &c.auth.tokens_file));
      KVCD_RETURN_IF_ERROR(r.Read(auth, "reload_interval_ms", "auth.", &c.auth.reload_interval_ms));
    }
    if (const YAML::Node cl = root["cluster"]) {
      ClusterConfig& k = c.cluster;
      k.present = true;
      const std::string w = "cluster.";
      KVCD_RETURN_IF_ERROR(r.Read(cl, "name", w, &k.name));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "member_id", w, &k.member_id));
      if (cl["membership"]) k.membership = r.Take(cl, "membership", w);  // schema: the enum
      if (const YAML::Node eps = cl["etcd_endpoints"]) {
        for (size_t i = 0; i < eps.size(); ++i) {
          k.etcd_endpoints.push_back(eps[i].as<std::string>());
          r.Mark(absl::StrCat(w, "etcd_endpoints[", i, "]"));
        }
        r.Mark(w + "etcd_endpoints");
      }
      KVCD_RETURN_IF_ERROR(r.Read(cl, "lease_ttl_s", w, &k.lease_ttl_s));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "dns_name", w, &k.dns_name));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "redis_url", w, &k.redis_url));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "load_interval_ms", w, &k.load_interval_ms));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "events_endpoint", w, &k.events_endpoint));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "events_replay_endpoint", w, &k.events_replay_endpoint));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "events_buffer", w, &k.events_buffer));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "advertise_address", w, &k.advertise_address));
      KVCD_RETURN_IF_ERROR(r.Read(cl, "peer_token_file", w, &k.peer_token_file));
      if (cl["pull_transport"]) k.pull_transport = r.Take(cl, "pull_transport", w);  // the enum
    }
    if (const YAML::Node quotas = root["quotas"]) {
      if (const YAML::Node d = quotas["default"]) {
        if (d["tenant"]) {
          return absl::InvalidArgumentError(
              "quotas.default.tenant: the defaults apply to every tenant; name one tenant in a "
              "quotas.tenants entry instead");
        }
        KVCD_RETURN_IF_ERROR(ReadQuota(r, d, "quotas.default", &c.quotas.defaults));
      }
      if (const YAML::Node tenants = quotas["tenants"]) {
        for (size_t i = 0; i < tenants.size(); ++i) {
          const std::string where = absl::StrCat("quotas.tenants[", i, "]");
          const std::string name = r.Take(tenants[i], "tenant", where + ".");  // schema: required
          TenantQuota q = c.quotas.defaults;  // keys not given: the defaults
          KVCD_RETURN_IF_ERROR(ReadQuota(r, tenants[i], where, &q));
          if (!c.quotas.tenants.emplace(name, q).second) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ": tenant '", name, "' appears twice"));
          }
        }
      }
    }
    if (const YAML::Node models = root["models"]) {
      for (size_t i = 0; i < models.size(); ++i) {
        ModelSpec spec;
        KVCD_RETURN_IF_ERROR(ReadModel(r, models[i], static_cast<int>(i), &spec));
        c.models.push_back(spec);
      }
    }
    KVCD_RETURN_IF_ERROR(r.CheckAllRead(root, ""));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", e.what()));
  }
  // 3. What the schema cannot say: one key against another, a model's geometry.
  for (const ModelSpec& m : c.models) KVCD_RETURN_IF_ERROR(ValidateModelSpec(m));
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
  if (c.tls.cert_file.empty() != c.tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls.cert_file and tls.key_file go together: set both (PEM certificate chain and its "
        "private key) or neither");
  }
  if (!c.tls.client_ca_file.empty() && c.tls.cert_file.empty()) {
    return absl::InvalidArgumentError(
        "tls.client_ca_file (mutual TLS) needs tls.cert_file and tls.key_file as well");
  }
  KVCD_RETURN_IF_ERROR(CheckClusterConfig(&c.cluster));
  if (c.cluster.present && c.cluster.membership == "dns" && c.auth.enabled() &&
      c.cluster.peer_token_file.empty()) {
    return absl::InvalidArgumentError(
        "cluster.membership is dns and auth is on, but cluster.peer_token_file is empty: DNS "
        "membership asks each address for its Stats, which needs a token; name a file holding "
        "one (any token of the tokens file; a \"*\" token lets peers see the load figures)");
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
