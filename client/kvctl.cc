// kvctl: command-line client of the kvcd daemon.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/cli.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "daemon address HOST:PORT ($KVCD_TARGET if unset)");
ABSL_FLAG(int64_t, deadline_ms, 30000,
          "deadline in milliseconds of each call, and of connecting to the daemon");
ABSL_FLAG(std::string, token_file, "",
          "bearer token file for a daemon with auth.tokens_file (or $KVCD_TOKEN, "
          "$KVCD_TOKEN_FILE); never a token itself on the command line");
ABSL_FLAG(std::string, tls_ca, "",
          "use TLS, trusting this PEM CA for the daemon's certificate (or $KVCD_TLS_CA)");
ABSL_FLAG(std::string, tls_cert, "",
          "mutual TLS: this client's PEM certificate (or $KVCD_TLS_CERT)");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: its PEM private key (or $KVCD_TLS_KEY)");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to verify in the daemon's certificate instead of the target's host (or "
          "$KVCD_TLS_SERVER_NAME)");
ABSL_FLAG(std::string, profile, "", "kvcd.v1.ModelProfile in protobuf text format");
ABSL_FLAG(std::string, codec, "", "the model's codec file (safetensors)");
ABSL_FLAG(std::string, tenant, "", "tenant whose quotas the model counts against");
ABSL_FLAG(std::string, model, "", "model name");
ABSL_FLAG(std::string, salt, "", "cache salt (prompts under different salts never share pages)");
ABSL_FLAG(int64_t, synthetic, 0, "a deterministic synthetic prompt of this many tokens");
ABSL_FLAG(int64_t, seed, 1, "seed of the synthetic prompt");
ABSL_FLAG(std::string, safetensors, "", "prompt file: tokens, k, v (and x for FSQ models)");
ABSL_FLAG(std::string, tokens, "", "the prompt's token ids, comma-separated");
ABSL_FLAG(int64_t, steps, 8, "decode steps");
ABSL_FLAG(int64_t, ttl_ms, 0,
          "pin: how long the pin lasts, in ms, 1..the daemon's max_pin_ttl_ms (24 h unless "
          "configured); required");
ABSL_FLAG(int64_t, lease_ms, 0, "the fork's lease in milliseconds (0: the daemon's default)");
ABSL_FLAG(bool, commit, false, "commit the sequence's full pages to the prefix cache first");

namespace {

const std::vector<std::string> kPrompt = {"model", "salt", "synthetic", "seed"};

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvctl",
      .summary = "command-line client of the kvcd KV-cache daemon",
      .files = {__FILE__},
      .global_flags = {"target", "deadline_ms", "token_file", "tls_ca", "tls_cert", "tls_key",
                       "tls_server_name"},
      .commands =
          {{.name = "health", .synopsis = "", .description = "grpc.health.v1 status of the daemon"},
           {.name = "stats",
            .synopsis = "",
            .description = "memory, pools, prefix-cache hit ratio, sequences, prefix pins"},
           {.name = "models",
            .synopsis = "",
            .description = "registered model profiles and their pools"},
           {.name = "register",
            .synopsis = "--profile FILE [--codec FILE] [--tenant T]",
            .description = R"(register a model at run time
FILE holds a kvcd.v1.ModelProfile in protobuf text format (name: "m" num_layers: 2
...); --codec the model's codec file (safetensors: an INT2 rotation profile, an FSQ
codec or a transform code); --tenant the tenant whose quotas it counts against.
Prints the model and its pools.)",
            .flags = {"profile", "codec", "tenant"}},
           {.name = "put",
            .synopsis = "--model M [--salt S] (--synthetic N [--seed X] | --safetensors FILE)",
            .description = R"(cache a prompt's K/V
A safetensors file holds 'tokens' (I32 [n]), 'k' and 'v' (BF16 or F32 [layers, n,
kv_heads, head_dim]), and for FSQ models 'x' (BF16 or F32 [layers, n, C], the
residuals). --synthetic N makes a deterministic N-token prompt from --seed (with
synthetic residuals for FSQ models).)",
            .flags = Concat(kPrompt, {"safetensors"})},
           {.name = "match",
            .synopsis = "--model M [--salt S] (--tokens 1,2,3 | --synthetic N [--seed X])",
            .description = "longest cached prefix, in tokens",
            .flags = Concat(kPrompt, {"tokens"})},
           {.name = "pin",
            .synopsis = "--model M [--salt S] (--tokens 1,2,3 | --synthetic N [--seed X]) "
                        "--ttl-ms N",
            .description = R"(pin a cached prefix so that eviction skips it
Pins the longest cached page-aligned prefix of the tokens for --ttl-ms ms (or until
'kvctl unpin'); the pages count against the tenant's max_pinned_prefix_pages. Prints
the pin id, the pinned tokens and pages, and when the pin expires (UTC).)",
            .flags = Concat(kPrompt, {"tokens", "ttl_ms"})},
           {.name = "unpin",
            .synopsis = "PIN_ID",
            .description = R"(remove a prefix pin
Its pages are ordinary LRU pages again. Prints how many pages it pinned.)",
            .takes_args = true},
           {.name = "decode",
            .synopsis = "--model M [--salt S] --synthetic N [--seed X] [--steps K]",
            .description = R"(demo decode loop
Opens a sequence on the synthetic prompt, appends the uncached tail, then runs K
steps of per-layer fused append+attention over one AttentionDecodeStream; prints
the per-step latency and tokens/s.)",
            .flags = Concat(kPrompt, {"steps"})},
           {.name = "commit",
            .synopsis = "SEQUENCE_ID",
            .description = R"(commit an open sequence's full pages to the prefix cache
The sequence stays open; a later OpenSequence on its tokens reuses them
(docs/sessions.md). Prints the committed, inserted and deduplicated counts.)",
            .takes_args = true},
           {.name = "fork",
            .synopsis = "SEQUENCE_ID [--lease-ms MS]",
            .description = R"(fork an open sequence
The new sequence shares every full page of the source and gets a copy of its
partial page, with its own lease. Prints the new sequence's id.)",
            .flags = {"lease_ms"},
            .takes_args = true},
           {.name = "close",
            .synopsis = "SEQUENCE_ID [--commit]",
            .description = R"(close an open sequence
With --commit its full pages enter the prefix cache first (a failed commit leaves
it open).)",
            .flags = {"commit"},
            .takes_args = true}},
      .notes = R"(Examples:
  kvctl register --profile small.textproto --codec small-codec.safetensors
  kvctl put --model qwen3-8b --synthetic 4096 --seed 7
  kvctl match --model qwen3-8b --synthetic 4096 --seed 7
  kvctl pin --model qwen3-8b --synthetic 4096 --seed 7 --ttl-ms 3600000
  kvctl unpin 1234567890123456789
  kvctl decode --model qwen3-8b --synthetic 4100 --seed 7 --steps 16
  kvctl fork 1234567890 --lease-ms 60000
  kvctl close 1234567890 --commit
)"};
  return program;
}

using Args = kvcd::cli::Parsed;

int Usage(const Args& a, const char* why) { return kvcd::cli::UsageError(Cli(), a.command, why); }

// A call's failure: the daemon's gRPC code and message.
int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvctl: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return 1;
}

// A failure on this machine (a file given on the command line): the message alone.
int FailLocal(const Args& a, const absl::Status& s) {
  std::fprintf(stderr, "kvctl %s: %s\n", a.command->name.c_str(), std::string(s.message()).c_str());
  return 1;
}

void PrintModel(const kvcd::v1::ModelInfo& m) {
  const auto& p = m.profile();
  std::printf(
      "%s: %d layers, %d q / %d kv heads, head_dim %d, page %d, sink %d, recent %d, "
      "history %s, codec %s\n",
      p.name().c_str(), p.num_layers(), p.num_q_heads(), p.num_kv_heads(), p.head_dim(),
      p.page_size(), p.sink_tokens(), p.recent_tokens(),
      kvcd::v1::HistoryFormat_Name(p.history_format()).c_str(), m.codec().c_str());
  for (const auto& pool : m.pools()) {
    std::printf("  pool %-10s %8llu / %8llu pages used, %llu bytes per page\n",
                pool.format().c_str(), static_cast<unsigned long long>(pool.pages_used()),
                static_cast<unsigned long long>(pool.pages_total()),
                static_cast<unsigned long long>(pool.page_bytes()));
  }
  std::printf("  cached tokens %llu, active sequences %llu\n",
              static_cast<unsigned long long>(m.cached_tokens()),
              static_cast<unsigned long long>(m.active_sequences()));
}

// "2026-12-05 01:02:03 UTC (in 59 s)" for a unix time in ms.
std::string Until(int64_t unix_ms) {
  const absl::Time t = absl::FromUnixMillis(unix_ms);
  const int64_t left = (unix_ms - absl::ToUnixMillis(absl::Now()) + 999) / 1000;
  return absl::StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", t, absl::UTCTimeZone()), " (",
                      left > 0 ? absl::StrCat("in ", left, " s") : "due now", ")");
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open ", what, " '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", what, " '", path, "'"));
  return bytes.str();
}

// Keeps the first parse error of a text-format file with its line and column (1-based).
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (error_.empty())
      error_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
  }
  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

// What `register` sends: the profile and the codec file's bytes.
struct Registration {
  kvcd::v1::ModelProfile profile;
  std::string codec;
};

// Reads register's files before connecting: a missing or malformed file is a problem on this
// machine, reported as such (no gRPC code), whether or not a daemon answers.
absl::StatusOr<Registration> ReadRegistration() {
  const std::string path = absl::GetFlag(FLAGS_profile);
  Registration r;
  KVCD_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path, "profile file"));
  google::protobuf::TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &r.profile)) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile file '", path,
                     "' is not a kvcd.v1.ModelProfile in protobuf text format: ", errors.error()));
  }
  if (const std::string f = absl::GetFlag(FLAGS_codec); !f.empty()) {
    KVCD_ASSIGN_OR_RETURN(r.codec, ReadWholeFile(f, "codec file"));
  }
  return r;
}

int Register(kvcd::Client& c, const Registration& r) {
  auto info = c.RegisterModel(r.profile, r.codec, absl::GetFlag(FLAGS_tenant));
  if (!info.ok()) return Fail(info.status());
  std::printf("registered ");
  PrintModel(*info);
  return 0;
}

std::vector<int32_t> PromptTokens(const Args& a) {
  if (a.Given("tokens")) {
    std::vector<int32_t> t;
    for (absl::string_view s :
         absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',', absl::SkipEmpty())) {
      int32_t v;
      if (!absl::SimpleAtoi(s, &v)) {
        std::fprintf(stderr, "kvctl: --tokens must be comma-separated integers\n");
        std::exit(2);
      }
      t.push_back(v);
    }
    return t;
  }
  return kvcd::synthetic::Tokens(absl::GetFlag(FLAGS_seed), 0, absl::GetFlag(FLAGS_synthetic));
}

int Put(kvcd::Client& c, const Args& a) {
  auto model = c.GetModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Fail(model.status());
  kvcd::v1::PutRequest req;
  req.set_model(absl::GetFlag(FLAGS_model));
  req.set_cache_salt(absl::GetFlag(FLAGS_salt));
  const auto& p = model->profile();
  if (a.Given("safetensors")) {
    auto file = kvcd::SafetensorsFile::Load(absl::GetFlag(FLAGS_safetensors));
    if (!file.ok()) return Fail(file.status());
    auto tokens = file->Get("tokens");
    if (!tokens.ok()) return Fail(tokens.status());
    if (tokens->dtype != "I32" || tokens->shape.size() != 1) {
      return Fail(absl::InvalidArgumentError("tensor 'tokens' must be I32 [n]"));
    }
    const int32_t* tk = reinterpret_cast<const int32_t*>(tokens->data);
    req.mutable_tokens()->Add(tk, tk + tokens->shape[0]);
    for (const char* name : {"k", "v"}) {
      auto t = file->Get(name);
      if (!t.ok()) return Fail(t.status());
      if (t->dtype != "BF16" && t->dtype != "F32") {
        return Fail(absl::InvalidArgumentError(std::string("tensor '") + name + "' has dtype " +
                                               t->dtype + ", expected BF16 or F32"));
      }
      auto* ref = std::string(name) == "k" ? req.mutable_k() : req.mutable_v();
      ref->set_dtype(t->dtype == "BF16" ? kvcd::v1::DTYPE_BF16 : kvcd::v1::DTYPE_F32);
      for (int64_t d : t->shape) ref->add_shape(d);
      ref->set_inline_data(t->data, static_cast<size_t>(t->size_bytes));
    }
    if (file->Has("x")) {  // FSQ models: the residuals [layers, n, C]
      auto t = file->Get("x");
      if (!t.ok()) return Fail(t.status());
      if (t->dtype != "BF16" && t->dtype != "F32") {
        return Fail(absl::InvalidArgumentError("tensor 'x' has dtype " + t->dtype +
                                               ", expected BF16 or F32"));
      }
      auto* ref = req.mutable_x();
      ref->set_dtype(t->dtype == "BF16" ? kvcd::v1::DTYPE_BF16 : kvcd::v1::DTYPE_F32);
      for (int64_t d : t->shape) ref->add_shape(d);
      ref->set_inline_data(t->data, static_cast<size_t>(t->size_bytes));
    }
  } else if (a.Given("synthetic")) {
    const uint64_t seed = absl::GetFlag(FLAGS_seed);
    const int64_t n = absl::GetFlag(FLAGS_synthetic);
    const auto tokens = kvcd::synthetic::Tokens(seed, 0, n);
    req.mutable_tokens()->Add(tokens.begin(), tokens.end());
    const std::vector<int64_t> shape = {p.num_layers(), n, p.num_kv_heads(), p.head_dim()};
    kvcd::SetBf16FromFloat(req.mutable_k(), shape, kvcd::synthetic::Kv(seed, p, 0, n, 0).data());
    kvcd::SetBf16FromFloat(req.mutable_v(), shape, kvcd::synthetic::Kv(seed, p, 0, n, 1).data());
    if (p.history_format() == kvcd::v1::HISTORY_FORMAT_FSQ) {
      kvcd::SetBf16FromFloat(req.mutable_x(), {p.num_layers(), n, p.fsq_residual_width()},
                             kvcd::synthetic::Residuals(seed, p, 0, n).data());
    }
  } else {
    return Usage(a, "put needs --synthetic N or --safetensors FILE");
  }
  auto r = c.Put(req);
  if (!r.ok()) return Fail(r.status());
  std::printf("put %d tokens: %lld already cached, %lld inserted, %lld ignored (partial page)\n",
              req.tokens_size(), static_cast<long long>(r->cached_tokens()),
              static_cast<long long>(r->inserted_tokens()),
              static_cast<long long>(r->ignored_tokens()));
  return 0;
}

int Decode(kvcd::Client& c, const Args& a) {
  auto model = c.GetModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Fail(model.status());
  const auto& p = model->profile();
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const int64_t n = absl::GetFlag(FLAGS_synthetic);
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  if (n < 1) return Usage(a, "decode needs --synthetic N (N >= 1)");
  const auto tokens = kvcd::synthetic::Tokens(seed, 0, n);
  auto open = c.OpenSequence(p.name(), absl::GetFlag(FLAGS_salt), tokens);
  if (!open.ok()) return Fail(open.status());
  const int64_t matched = open->matched_tokens();
  std::printf("sequence %llu: %lld of %lld prompt tokens served from the prefix cache\n",
              static_cast<unsigned long long>(open->sequence_id()), static_cast<long long>(matched),
              static_cast<long long>(n));
  if (matched < n) {
    kvcd::v1::AppendRequest req;
    req.set_sequence_id(open->sequence_id());
    req.mutable_tokens()->Add(tokens.begin() + matched, tokens.end());
    const std::vector<int64_t> shape = {p.num_layers(), n - matched, p.num_kv_heads(),
                                        p.head_dim()};
    kvcd::SetBf16FromFloat(req.mutable_k(), shape,
                           kvcd::synthetic::Kv(seed, p, matched, n - matched, 0).data());
    kvcd::SetBf16FromFloat(req.mutable_v(), shape,
                           kvcd::synthetic::Kv(seed, p, matched, n - matched, 1).data());
    if (p.history_format() == kvcd::v1::HISTORY_FORMAT_FSQ) {
      kvcd::SetBf16FromFloat(req.mutable_x(), {p.num_layers(), n - matched, p.fsq_residual_width()},
                             kvcd::synthetic::Residuals(seed, p, matched, n - matched).data());
    }
    auto len = c.Append(req);
    if (!len.ok()) return Fail(len.status());
  }
  auto stream = c.OpenDecodeStream();
  if (!stream.ok()) return Fail(stream.status());
  double kernel = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t pos = n + s;
    const auto ts = std::chrono::steady_clock::now();
    for (int32_t l = 0; l < p.num_layers(); ++l) {
      kvcd::v1::AttentionDecodeRequest req;
      req.set_layer(l);
      req.add_sequence_ids(open->sequence_id());
      req.set_request_id(static_cast<uint64_t>(s * p.num_layers() + l));
      kvcd::SetF32Tensor(req.mutable_q(), {1, p.num_q_heads(), p.head_dim()},
                         kvcd::synthetic::Row(seed, p, l, pos, 2).data());
      kvcd::SetBf16FromFloat(req.mutable_k_new(), {1, p.num_kv_heads(), p.head_dim()},
                             kvcd::synthetic::Row(seed, p, l, pos, 0).data());
      kvcd::SetBf16FromFloat(req.mutable_v_new(), {1, p.num_kv_heads(), p.head_dim()},
                             kvcd::synthetic::Row(seed, p, l, pos, 1).data());
      if (p.history_format() == kvcd::v1::HISTORY_FORMAT_FSQ) {
        kvcd::SetBf16FromFloat(req.mutable_x_new(), {1, p.fsq_residual_width()},
                               kvcd::synthetic::ResidualRow(seed, p, l, pos).data());
      }
      req.add_new_tokens(kvcd::synthetic::Token(seed, pos));
      auto r = (*stream)->Call(req);
      if (!r.ok()) return Fail(r.status());
      kernel += r->kernel_seconds();
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - ts).count();
    std::printf("step %3lld: context %lld tokens, %d layers in %.2f ms\n",
                static_cast<long long>(s), static_cast<long long>(pos + 1), p.num_layers(), ms);
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%lld steps in %.3f s: %.1f tokens/s (kernel %.1f%% of the time)\n",
              static_cast<long long>(steps), total, steps / total, 100.0 * kernel / total);
  auto closed = (*stream)->Close();
  if (!closed.ok()) return Fail(closed);
  auto len = c.CloseSequence(open->sequence_id());
  if (!len.ok()) return Fail(len.status());
  return 0;
}

int Pin(kvcd::Client& c, const Args& a) {
  if (!a.Given("ttl_ms")) return Usage(a, "pin needs --ttl-ms N");
  if (!a.Given("tokens") && absl::GetFlag(FLAGS_synthetic) < 1) {
    return Usage(a, "pin needs --tokens 1,2,3 or --synthetic N (N >= 1)");
  }
  auto r = c.PinPrefix(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_salt), PromptTokens(a),
                       absl::GetFlag(FLAGS_ttl_ms));
  if (!r.ok()) return Fail(r.status());
  std::printf("pin %llu: %lld tokens (%lld pages) pinned until %s\n",
              static_cast<unsigned long long>(r->pin_id()),
              static_cast<long long>(r->pinned_tokens()), static_cast<long long>(r->pinned_pages()),
              Until(r->expires_unix_ms()).c_str());
  return 0;
}

int Unpin(kvcd::Client& c, const Args& a) {
  uint64_t id = 0;
  if (a.args.size() != 1 || !absl::SimpleAtoi(a.args[0], &id)) {
    return Usage(a, "unpin needs one PIN_ID (the number 'kvctl pin' printed)");
  }
  auto pages = c.UnpinPrefix(id);
  if (!pages.ok()) return Fail(pages.status());
  std::printf("pin %llu removed: %lld pages are ordinary LRU pages again\n",
              static_cast<unsigned long long>(id), static_cast<long long>(*pages));
  return 0;
}

// commit / fork / close SEQUENCE_ID.
int Session(kvcd::Client& c, const Args& a) {
  if (a.args.size() != 1) return Usage(a, "expected one SEQUENCE_ID");
  uint64_t id = 0;
  if (!absl::SimpleAtoi(a.args[0], &id)) {
    return Usage(a, "SEQUENCE_ID must be an unsigned 64-bit integer (OpenSequence's id)");
  }
  auto print_commit = [](const kvcd::v1::CommitSequenceResponse& r) {
    std::printf("committed %lld tokens: %lld pages inserted, %lld deduplicated\n",
                static_cast<long long>(r.committed_tokens()),
                static_cast<long long>(r.inserted_pages()),
                static_cast<long long>(r.deduplicated_pages()));
  };
  const std::string command = a.command->name;
  if (command == "commit") {
    auto r = c.CommitSequence(id);
    if (!r.ok()) return Fail(r.status());
    print_commit(*r);
    return 0;
  }
  if (command == "fork") {
    auto r = c.ForkSequence(id, absl::GetFlag(FLAGS_lease_ms));
    if (!r.ok()) return Fail(r.status());
    std::printf("%llu\n", static_cast<unsigned long long>(r->sequence_id()));
    std::fprintf(stderr, "fork of %llu: %lld tokens, %lld pages shared, lease %lld ms\n",
                 static_cast<unsigned long long>(id), static_cast<long long>(r->length()),
                 static_cast<long long>(r->shared_pages()), static_cast<long long>(r->lease_ms()));
    return 0;
  }
  const bool commit = absl::GetFlag(FLAGS_commit);
  auto r = c.CloseSequence(id, commit);
  if (!r.ok()) return Fail(r.status());
  if (commit) print_commit(r->commit());
  std::printf("closed at %lld tokens\n", static_cast<long long>(r->length()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = kvcd::cli::Parse(Cli(), argc, argv);
  const std::string command = a.command->name;
  kvcd::ClientOptions opts;
  opts.target = absl::GetFlag(FLAGS_target);
  if (const char* t = std::getenv("KVCD_TARGET"); t != nullptr && !a.Given("target")) {
    opts.target = t;
  }
  opts.deadline = std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  // --deadline-ms bounds the whole command, connecting included.
  opts.connect_timeout = std::min(opts.connect_timeout, opts.deadline);
  kvcd::ApplySecurityEnvironment(&opts);
  if (const std::string f = absl::GetFlag(FLAGS_token_file); !f.empty()) {
    auto t = kvcd::ReadTokenFile(f);
    if (!t.ok()) return Fail(t.status());
    opts.token = *t;
  }
  if (a.Given("tls_ca")) opts.tls_root_ca_file = absl::GetFlag(FLAGS_tls_ca);
  if (a.Given("tls_cert")) opts.tls_client_cert_file = absl::GetFlag(FLAGS_tls_cert);
  if (a.Given("tls_key")) opts.tls_client_key_file = absl::GetFlag(FLAGS_tls_key);
  if (a.Given("tls_server_name")) opts.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  // Local files first: their errors do not wait on (or blame) the daemon.
  absl::StatusOr<Registration> registration;
  if (command == "register") {
    if (!a.Given("profile")) return Usage(a, "register needs --profile FILE");
    registration = ReadRegistration();
    if (!registration.ok()) return FailLocal(a, registration.status());
  }
  auto client = kvcd::Client::Connect(opts);
  if (!client.ok()) return Fail(client.status());
  kvcd::Client& c = **client;
  if (command == "health") {
    auto h = c.Health();
    if (!h.ok()) return Fail(h.status());
    std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*h).c_str());
    return *h == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
  }
  if (command == "stats") {
    auto s = c.Stats();
    if (!s.ok()) return Fail(s.status());
    std::printf("kvcd %s, backend %s\n", s->version().c_str(), s->backend().c_str());
    std::printf("memory: %llu of %llu budget bytes in use\n",
                static_cast<unsigned long long>(s->memory_used_bytes()),
                static_cast<unsigned long long>(s->memory_budget_bytes()));
    std::printf("prefix cache: %llu hit / %llu miss tokens (hit ratio %.3f), %llu pages evicted\n",
                static_cast<unsigned long long>(s->hit_tokens()),
                static_cast<unsigned long long>(s->miss_tokens()), s->hit_ratio(),
                static_cast<unsigned long long>(s->evicted_pages()));
    std::printf(
        "sessions: %llu committed pages cached, %llu forks; hits %llu put / %llu committed "
        "tokens; evicted %llu put / %llu committed pages\n",
        static_cast<unsigned long long>(s->committed_pages()),
        static_cast<unsigned long long>(s->forks()),
        static_cast<unsigned long long>(s->hit_tokens_put()),
        static_cast<unsigned long long>(s->hit_tokens_committed()),
        static_cast<unsigned long long>(s->evicted_pages_put()),
        static_cast<unsigned long long>(s->evicted_pages_committed()));
    std::printf("sequences: %llu active, %llu leases expired; %llu pages demoted\n",
                static_cast<unsigned long long>(s->active_sequences()),
                static_cast<unsigned long long>(s->expired_leases()),
                static_cast<unsigned long long>(s->demoted_pages()));
    for (const auto& m : s->models()) PrintModel(m);
    for (const auto& t : s->tenants()) {
      if (t.pinned_prefix_pages() == 0 && t.max_pinned_prefix_pages() == 0) continue;
      std::printf("tenant '%s': %llu pages pinned by prefix pins (quota %s)\n", t.tenant().c_str(),
                  static_cast<unsigned long long>(t.pinned_prefix_pages()),
                  t.max_pinned_prefix_pages() == 0
                      ? "none"
                      : std::to_string(t.max_pinned_prefix_pages()).c_str());
    }
    std::printf("prefix pins: %d\n", s->pins_size());
    for (const auto& p : s->pins()) {
      std::printf("  pin %llu: tenant '%s', model %s, %lld tokens (%lld pages) until %s\n",
                  static_cast<unsigned long long>(p.pin_id()), p.tenant().c_str(),
                  p.model().c_str(), static_cast<long long>(p.pinned_tokens()),
                  static_cast<long long>(p.pinned_pages()), Until(p.expires_unix_ms()).c_str());
    }
    return 0;
  }
  if (command == "models") {
    auto models = c.ListModels();
    if (!models.ok()) return Fail(models.status());
    for (const auto& m : *models) PrintModel(m);
    return 0;
  }
  if (command == "register") return Register(c, *registration);
  if (command == "put") return Put(c, a);
  if (command == "match") {
    auto r = c.Match(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_salt), PromptTokens(a));
    if (!r.ok()) return Fail(r.status());
    std::printf("%lld tokens (%lld pages) cached\n", static_cast<long long>(r->matched_tokens()),
                static_cast<long long>(r->matched_pages()));
    return 0;
  }
  if (command == "decode") return Decode(c, a);
  if (command == "pin") return Pin(c, a);
  if (command == "unpin") return Unpin(c, a);
  if (command == "commit" || command == "fork" || command == "close") return Session(c, a);
  return Usage(a, "unknown command");  // Parse accepts only the commands above
}
