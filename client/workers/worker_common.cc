#include "client/workers/worker_common.h"

#include <algorithm>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "daemon address HOST:PORT");
ABSL_FLAG(std::string, model, "qwen3-8b-int2", "model whose pages the workers share");
ABSL_FLAG(std::string, salt, "prefill", "cache salt of the prompt");
ABSL_FLAG(int64_t, tokens, 32768, "prompt length in tokens (whole pages are used)");
ABSL_FLAG(int64_t, seed, 1, "seed of the synthetic prompt both workers agree on");
ABSL_FLAG(int32_t, device, 0, "CUDA device");
ABSL_FLAG(std::string, token_file, "",
          "bearer token file (or $KVCD_TOKEN, $KVCD_TOKEN_FILE); never a token on the "
          "command line");
ABSL_FLAG(std::string, tls_ca, "", "use TLS, trusting this PEM CA (or $KVCD_TLS_CA)");
ABSL_FLAG(std::string, tls_cert, "", "mutual TLS: client PEM certificate (or $KVCD_TLS_CERT)");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: its PEM private key (or $KVCD_TLS_KEY)");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to verify in the daemon's certificate (or $KVCD_TLS_SERVER_NAME)");

namespace kvcd::workers {

const char kFlagsFile[] = __FILE__;

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
  g.fsq = p.history_format() == v1::HISTORY_FORMAT_FSQ;
  g.fsq_residual_width = g.fsq ? p.fsq_residual_width() : 0;
  g.sink_pages = p.sink_tokens() / p.page_size();
  // The BF16 pool of sinks and windows is "bf16", or "bf16+fsq" for an FSQ model (its pages
  // keep each token's code beside its K/V); the other pool holds the history's pages.
  for (const auto& pool : info->pools()) {
    if (pool.format() == "bf16" || pool.format() == "bf16+fsq")
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

absl::Status ApplySecurityFlags(const cli::Parsed& flags, ClientOptions* options) {
  ApplySecurityEnvironment(options);
  if (const std::string f = absl::GetFlag(FLAGS_token_file); !f.empty()) {
    absl::StatusOr<std::string> t = ReadTokenFile(f);
    if (!t.ok()) return t.status();
    options->token = *t;
  }
  if (flags.Given("tls_ca")) options->tls_root_ca_file = absl::GetFlag(FLAGS_tls_ca);
  if (flags.Given("tls_cert")) options->tls_client_cert_file = absl::GetFlag(FLAGS_tls_cert);
  if (flags.Given("tls_key")) options->tls_client_key_file = absl::GetFlag(FLAGS_tls_key);
  if (flags.Given("tls_server_name")) {
    options->tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  }
  return absl::OkStatus();
}

}  // namespace kvcd::workers
