// Shared by the example workers: flags, the model geometry as the daemon reports it, the
// synthetic prompt, and the stored-page layout of a prefix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/cli.h"

ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, salt);
ABSL_DECLARE_FLAG(int64_t, tokens);
ABSL_DECLARE_FLAG(int64_t, seed);
ABSL_DECLARE_FLAG(int32_t, device);

namespace kvcd::workers {

// The flags both workers read: --target, --model, --salt, --tokens, --seed, --device, and
// the security ones (--token-file, --tls-ca, --tls-cert, --tls-key, --tls-server-name).
// Both workers list their own flags and these (kFlagsFile) in --help.
extern const char kFlagsFile[];

// Security options of a worker's client: the environment (ApplySecurityEnvironment),
// then --token-file, --tls-ca, --tls-cert, --tls-key, --tls-server-name when given.
absl::Status ApplySecurityFlags(const cli::Parsed& flags, ClientOptions* options);

struct Geometry {
  int num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, page_size = 0;
  int64_t sink_pages = 0;
  bool int2 = false;
  bool fsq = false;            // history_format FSQ: Put and decode calls also carry x
  int fsq_residual_width = 0;  // C of an FSQ model's residuals x
  int64_t bf16_page_bytes = 0, history_page_bytes = 0;  // all layers
  int64_t PageBytesAt(int64_t page) const {
    return int2 && page >= sink_pages ? history_page_bytes : bf16_page_bytes;
  }
};
absl::StatusOr<Geometry> FetchGeometry(Client* client, const std::string& model);

// The prompt both workers agree on: n token ids from `seed`.
std::vector<int32_t> PromptTokens(int64_t n, uint64_t seed);

// Median of the values (sorts a copy).
double Median(std::vector<double> v);
double Percentile(std::vector<double> v, double p);

}  // namespace kvcd::workers
