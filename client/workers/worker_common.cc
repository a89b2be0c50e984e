#include "client/workers/worker_common.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace kvcd::workers {

Flags::Flags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) continue;
    a = a.substr(2);
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      kv_.emplace_back(a.substr(0, eq), a.substr(eq + 1));
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      kv_.emplace_back(a, argv[++i]);
    } else {
      kv_.emplace_back(a, "1");
    }
  }
}

std::string Flags::Get(const std::string& name, const std::string& def) const {
  for (const auto& [k, v] : kv_)
    if (k == name) return v;
  return def;
}

int64_t Flags::GetInt(const std::string& name, int64_t def) const {
  return Has(name) ? std::atoll(Get(name, "").c_str()) : def;
}

bool Flags::Has(const std::string& name) const {
  for (const auto& [k, v] : kv_)
    if (k == name) return true;
  return false;
}

absl::StatusOr<Geometry> FetchGeometry(Client* client, const std::string& model) {
  auto info = client->GetModel(model);
  if (!info.ok()) return info.status();
  const v1::ModelProfile& p = info->profile();
  Geometry g;
  g.num_layers = p.num_layers();
  g.num_q_heads = p.num_q_heads();
  g.num_kv_heads = p.num_kv_heads();
  g.head_dim = p.head_dim();
  g.page_size = p.page_size();
  g.int2 = p.history_format() == v1::HISTORY_FORMAT_INT2_OSCAR;
  g.sink_pages = p.sink_tokens() / p.page_size();
  for (const auto& pool : info->pools()) {
    if (pool.format() == "bf16")
      g.bf16_page_bytes = static_cast<int64_t>(pool.page_bytes());
    else
      g.history_page_bytes = static_cast<int64_t>(pool.page_bytes());
  }
  if (g.bf16_page_bytes == 0 || (g.int2 && g.history_page_bytes == 0)) {
    return absl::FailedPreconditionError(absl::StrCat("model ", model, " reports no page pools"));
  }
  return g;
}

std::vector<int32_t> PromptTokens(int64_t n, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (auto& v : t) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = static_cast<int32_t>(x % 151000);
  }
  return t;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

absl::Status ApplySecurityFlags(const Flags& flags, ClientOptions* options) {
  ApplySecurityEnvironment(options);
  if (const std::string f = flags.Get("token-file", ""); !f.empty()) {
    absl::StatusOr<std::string> t = ReadTokenFile(f);
    if (!t.ok()) return t.status();
    options->token = *t;
  }
  options->tls_root_ca_file = flags.Get("tls-ca", options->tls_root_ca_file);
  options->tls_client_cert_file = flags.Get("tls-cert", options->tls_client_cert_file);
  options->tls_client_key_file = flags.Get("tls-key", options->tls_client_key_file);
  options->tls_server_name = flags.Get("tls-server-name", options->tls_server_name);
  return absl::OkStatus();
}

}  // namespace kvcd::workers
