// cluster_xfer_bench: one PullPrefix between two running daemons of a cluster
// (docs/cluster.md "Transports"), measured and checked. Daemon A holds a prefix (--fill
// puts --tokens tokens of seeded random K/V there first, in chunks); daemon B pulls it
// from member --peer. The tool then checks that B holds the same bytes as A (every page as
// stored, format and data) and that attention over the prefix gives the same output and
// LSE on both (a seeded query, three layers), and prints one Markdown row: model, tokens,
// bytes, pull time, GB/s, the transport B's metrics credit, the byte and attention checks.
// Exit status 0 only when the pull stored the prefix and both checks hold.
// bench/run-h200-cluster-xfer.sh runs it once per transport.
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "common/cli.h"
#include "kvcd/kernels/bf16.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

ABSL_FLAG(std::string, a, "", "daemon A (the peer holding the prefix), HOST:PORT");
ABSL_FLAG(std::string, b, "", "daemon B (the puller), HOST:PORT");
ABSL_FLAG(std::string, peer, "a", "A's member id");
ABSL_FLAG(std::string, model, "q8-int2", "model");
ABSL_FLAG(int64_t, tokens, 32768, "prefix length in tokens");
ABSL_FLAG(uint64_t, seed, 1, "seed of the tokens, K/V and query");
ABSL_FLAG(bool, fill, false, "put the prefix on A first (skipped when A holds it)");
ABSL_FLAG(int64_t, put_chunk, 512, "tokens per Put of --fill");
ABSL_FLAG(std::string, transport, "",
          "the transport expected (a label for the row; the metrics say what moved the pages)");
ABSL_FLAG(std::string, b_metrics, "",
          "B's Prometheus exposer HOST:PORT: the row names the transport B's metrics credit");
ABSL_FLAG(std::string, results, "", "append the row to this Markdown file");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "cluster_xfer_bench",
      .summary = "one PullPrefix between two daemons, timed, with byte and attention checks",
      .files = {__FILE__},
      .synopsis = R"(--a HOST:PORT --b HOST:PORT [--peer ID] [--model NAME] [--tokens N]
    [--seed S] [--fill] [--put-chunk N] [--transport LABEL] [--results FILE])"};
  return program;
}

using Clock = std::chrono::steady_clock;

std::unique_ptr<kvcd::Client> Connect(const std::string& target) {
  kvcd::ClientOptions o;
  o.target = target;
  o.deadline = std::chrono::milliseconds(600000);
  o.max_message_bytes = 1ll << 30;
  auto c = kvcd::Client::Connect(o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect %s: %s\n", target.c_str(), c.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*c);
}

// Seeded values in [-1, 1) as BF16, fast (xorshift64*).
void Fill(uint64_t* state, std::vector<uint16_t>* out) {
  for (uint16_t& v : *out) {
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    const float f = static_cast<float>((x * 2685821657736338717ull) >> 40) / 8388608.0f - 1.0f;
    v = kvcd::kernels::FloatToBf16(f);
  }
}

bool FillPrefix(kvcd::Client* a, const kvcd::v1::ModelProfile& p, const std::string& model,
                const std::vector<int32_t>& tokens, uint64_t seed, int64_t chunk) {
  auto held = a->Match(model, "", tokens);
  if (held.ok() && held->matched_tokens() >= static_cast<int64_t>(tokens.size())) return true;
  const int64_t n = static_cast<int64_t>(tokens.size());
  chunk = std::max<int64_t>(chunk / p.page_size(), 1) * p.page_size();
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  std::vector<uint16_t> k, v;
  for (int64_t first = 0; first < n; first += chunk) {
    const int64_t m = std::min(chunk, n - first);
    kvcd::v1::PutRequest put;
    put.set_model(model);
    put.mutable_tokens()->Assign(tokens.begin(), tokens.begin() + first + m);
    put.set_kv_first_token(first);
    const std::vector<int64_t> shape = {p.num_layers(), m, p.num_kv_heads(), p.head_dim()};
    k.resize(static_cast<size_t>(p.num_layers() * m * p.num_kv_heads() * p.head_dim()));
    v.resize(k.size());
    Fill(&state, &k);
    Fill(&state, &v);
    kvcd::SetBf16Tensor(put.mutable_k(), shape, k.data());
    kvcd::SetBf16Tensor(put.mutable_v(), shape, v.data());
    auto r = a->Put(put);
    if (!r.ok()) {
      std::fprintf(stderr, "Put [%lld, +%lld) on A: %s\n", static_cast<long long>(first),
                   static_cast<long long>(m), r.status().ToString().c_str());
      return false;
    }
  }
  return true;
}

// Compares the prefix's pages as stored on A and B, fetch by fetch; returns the bytes
// compared, or -1 (and says where) when they differ.
int64_t ComparePages(kvcd::Client* a, kvcd::Client* b, uint64_t sa, uint64_t sb, int64_t n,
                     int64_t page_size, int64_t page_bytes_bound) {
  const int64_t per_fetch =
      std::max<int64_t>(1, ((int64_t{200} << 20) / page_bytes_bound)) * page_size;
  int64_t compared = 0;
  for (int64_t first = 0; first < n; first += per_fetch) {
    kvcd::v1::FetchPagesRequest f;
    f.set_first_token(first);
    f.set_num_tokens(std::min(per_fetch, n - first));
    f.set_sequence_id(sa);
    auto pa = a->FetchPages(f);
    f.set_sequence_id(sb);
    auto pb = b->FetchPages(f);
    if (!pa.ok() || !pb.ok()) {
      std::fprintf(stderr, "FetchPages at %lld: A %s, B %s\n", static_cast<long long>(first),
                   pa.status().ToString().c_str(), pb.status().ToString().c_str());
      return -1;
    }
    if (pa->pages_size() != pb->pages_size()) {
      std::fprintf(stderr, "at %lld: A answered %d pages, B %d\n", static_cast<long long>(first),
                   pa->pages_size(), pb->pages_size());
      return -1;
    }
    for (int i = 0; i < pa->pages_size(); ++i) {
      const auto& x = pa->pages(i);
      const auto& y = pb->pages(i);
      if (x.format() != y.format() || x.first_token() != y.first_token() || x.data() != y.data()) {
        std::fprintf(stderr, "page at token %lld differs: A %s %zu bytes, B %s %zu bytes\n",
                     static_cast<long long>(x.first_token()), x.format().c_str(), x.data().size(),
                     y.format().c_str(), y.data().size());
        return -1;
      }
      compared += static_cast<int64_t>(x.data().size());
    }
  }
  return compared;
}

// Attention over the prefix on A and B with the same query at three layers; the largest
// absolute difference of o and lse (0 when bitwise equal), or NaN when a call failed.
double CompareAttention(kvcd::Client* a, kvcd::Client* b, uint64_t sa, uint64_t sb,
                        const kvcd::v1::ModelProfile& p, uint64_t seed) {
  double worst = 0;
  const int64_t hq = p.num_q_heads(), d = p.head_dim();
  for (int32_t layer : {0, p.num_layers() / 2, p.num_layers() - 1}) {
    std::vector<float> q(static_cast<size_t>(hq * d));
    uint64_t state = seed * 31 + static_cast<uint64_t>(layer) + 7;
    std::vector<uint16_t> bits(q.size());
    Fill(&state, &bits);
    for (size_t i = 0; i < q.size(); ++i) q[i] = 4.0f * kvcd::kernels::Bf16ToFloat(bits[i]);
    kvcd::v1::AttentionDecodeRequest r;
    r.set_layer(layer);
    kvcd::SetF32Tensor(r.mutable_q(), {1, hq, d}, q.data());
    r.add_sequence_ids(sa);
    auto oa = a->AttentionDecode(r);
    r.set_sequence_ids(0, sb);
    auto ob = b->AttentionDecode(r);
    if (!oa.ok() || !ob.ok()) {
      std::fprintf(stderr, "AttentionDecode layer %d: A %s, B %s\n", layer,
                   oa.status().ToString().c_str(), ob.status().ToString().c_str());
      return std::nan("");
    }
    for (int64_t i = 0; i < hq * d; ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(kvcd::ElementAsFloat(oa->o(), i)) -
                                       kvcd::ElementAsFloat(ob->o(), i)));
    }
    for (int64_t i = 0; i < hq; ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(kvcd::ElementAsFloat(oa->lse(), i)) -
                                       kvcd::ElementAsFloat(ob->lse(), i)));
    }
  }
  return worst;
}

// GET http://host:port/metrics (HTTP/1.0, read to the end); empty on failure.
std::string Scrape(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return "";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(address.substr(0, colon).c_str(), address.substr(colon + 1).c_str(), &hints,
                  &res) != 0) {
    return "";
  }
  std::string body;
  const int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    const std::string get = "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
    if (write(fd, get.data(), get.size()) == static_cast<ssize_t>(get.size())) {
      char buf[65536];
      ssize_t got;
      while ((got = read(fd, buf, sizeof(buf))) > 0) body.append(buf, static_cast<size_t>(got));
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return body;
}

// The transport B's metrics credit with pulls (the one with a non-zero count).
std::string MeteredTransport(const std::string& address) {
  std::istringstream in(Scrape(address));
  std::string line, found = "?";
  const std::string key = "kvcd_cluster_pulls_by_transport_total{transport=\"";
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    const size_t end = line.find('"', key.size());
    const double count = std::atof(line.substr(line.rfind(' ') + 1).c_str());
    if (end != std::string::npos && count > 0) found = line.substr(key.size(), end - key.size());
  }
  return found;
}

}  // namespace

int main(int argc, char** argv) {
  kvcd::cli::Parse(Cli(), argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model);
  const int64_t n = absl::GetFlag(FLAGS_tokens);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (absl::GetFlag(FLAGS_a).empty() || absl::GetFlag(FLAGS_b).empty()) {
    return kvcd::cli::UsageError(Cli(), nullptr, "--a and --b are required");
  }
  auto a = Connect(absl::GetFlag(FLAGS_a));
  auto b = Connect(absl::GetFlag(FLAGS_b));
  if (!a || !b) return 1;
  auto info = a->GetModel(model);
  if (!info.ok()) {
    std::fprintf(stderr, "model %s on A: %s\n", model.c_str(), info.status().ToString().c_str());
    return 1;
  }
  const kvcd::v1::ModelProfile& p = info->profile();
  const std::vector<int32_t> tokens = kvcd::synthetic::Tokens(seed, 0, n);
  if (absl::GetFlag(FLAGS_fill)) {
    const auto t0 = Clock::now();
    if (!FillPrefix(a.get(), p, model, tokens, seed, absl::GetFlag(FLAGS_put_chunk))) return 1;
    std::printf("filled A with %lld tokens of %s in %.1f s\n", static_cast<long long>(n),
                model.c_str(), std::chrono::duration<double>(Clock::now() - t0).count());
  }
  auto before = b->Match(model, "", tokens);
  kvcd::v1::PullPrefixRequest pull;
  pull.set_model(model);
  *pull.mutable_tokens() = {tokens.begin(), tokens.end()};
  pull.set_peer_member_id(absl::GetFlag(FLAGS_peer));
  // B knows A once its membership watch has A's key: NOT_FOUND until then (bounded).
  absl::StatusOr<kvcd::v1::PullPrefixResponse> pulled;
  double seconds = 0;
  for (int attempt = 0; attempt < 150; ++attempt) {
    const auto t0 = Clock::now();
    pulled = b->PullPrefix(pull);
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (pulled.ok() || pulled.status().code() != absl::StatusCode::kNotFound) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!pulled.ok()) {
    std::fprintf(stderr, "PullPrefix on B: %s\n", pulled.status().ToString().c_str());
    if (!absl::GetFlag(FLAGS_results).empty()) {
      std::ofstream out(absl::GetFlag(FLAGS_results), std::ios::app);
      out << "| " << absl::GetFlag(FLAGS_transport) << " | | " << model << " | " << n
          << " | | | | | | refused in " << absl::StrFormat("%.1f", seconds * 1e3)
          << " ms: " << absl::StatusCodeToString(pulled.status().code()) << " |\n";
    }
    return 1;
  }
  const int64_t held_before = before.ok() ? before->matched_tokens() : -1;
  std::printf("pulled %lld tokens, %lld bytes in %.3f s (B held %lld before)\n",
              static_cast<long long>(pulled->pulled_tokens()),
              static_cast<long long>(pulled->pulled_bytes()), seconds,
              static_cast<long long>(held_before));

  auto oa = a->OpenSequence(model, "", tokens, 120000);
  auto ob = b->OpenSequence(model, "", tokens, 120000);
  if (!oa.ok() || !ob.ok()) {
    std::fprintf(stderr, "OpenSequence: A %s, B %s\n", oa.status().ToString().c_str(),
                 ob.status().ToString().c_str());
    return 1;
  }
  const int64_t matched = std::min(oa->matched_tokens(), ob->matched_tokens());
  const int64_t bf16_page =
      int64_t{4} * p.num_layers() * p.num_kv_heads() * p.head_dim() * p.page_size();
  const int64_t compared = ComparePages(a.get(), b.get(), oa->sequence_id(), ob->sequence_id(),
                                        matched, p.page_size(), bf16_page);
  const double attn =
      CompareAttention(a.get(), b.get(), oa->sequence_id(), ob->sequence_id(), p, seed);
  (void)a->CloseSequence(oa->sequence_id());
  (void)b->CloseSequence(ob->sequence_id());
  const bool full =
      oa->matched_tokens() == ob->matched_tokens() && matched == n / p.page_size() * p.page_size();
  const bool ok = full && compared > 0 && attn == 0 && pulled->pulled_tokens() > 0;
  const std::string metered = absl::GetFlag(FLAGS_b_metrics).empty()
                                  ? ""
                                  : MeteredTransport(absl::GetFlag(FLAGS_b_metrics));
  const double gbps = static_cast<double>(pulled->pulled_bytes()) / seconds / 1e9;
  const std::string row = absl::StrFormat(
      "| %s | %s | %s | %lld | %.1f MB | %.1f ms | %.2f GB/s | %s | %s | %s |\n",
      absl::GetFlag(FLAGS_transport), metered, model, static_cast<long long>(n),
      pulled->pulled_bytes() / 1e6, seconds * 1e3, gbps,
      compared > 0 ? absl::StrCat("equal (", compared, " B)") : "DIFFER",
      std::isnan(attn) ? "FAILED" : (attn == 0 ? "equal" : absl::StrFormat("max diff %.3g", attn)),
      ok ? "ok" : "FAIL");
  std::fputs(row.c_str(), stdout);
  if (!absl::GetFlag(FLAGS_results).empty()) {
    std::ofstream out(absl::GetFlag(FLAGS_results), std::ios::app);
    out << row;
  }
  return ok ? 0 : 1;
}
