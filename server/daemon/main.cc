// kvcd: the KV-cache daemon.
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "common/log.h"
#include "kvcd/kernels/cpu_features.h"
#include "kvcd_commit.h"
#include "server/config/config.h"
#include "server/daemon/daemon.h"
#include "server/daemon/grpc_log.h"
#include "server/daemon/protobuf_log.h"
#include "server/rpc/auth.h"
#include "server/rpc/tls.h"

ABSL_FLAG(std::string, config, "", "YAML config file (keys: docs/operating.md, \"Configuration\")");
ABSL_FLAG(std::string, listen, "", "gRPC address HOST:PORT; overrides the config's listen");
ABSL_FLAG(std::string, metrics_listen, "",
          "Prometheus address HOST:PORT (empty: off); overrides the config's metrics_listen");
ABSL_FLAG(std::string, health_listen, "",
          "plaintext health address HOST:PORT; overrides the config's health_listen");
ABSL_FLAG(bool, insecure, false,
          "serve a non-loopback address without TLS and tokens (logged; never on an untrusted "
          "network)");
ABSL_FLAG(std::string, log_format, "text",
          "the log's lines on stderr: text (time, level, source, message) or json (one object "
          "per line: time, level, source, message)");
ABSL_FLAG(std::string, fault_inject, "",
          "tests only: alloc:N, copy:N, attend:N or sticky:KIND:N, comma-separated, makes the "
          "backend fail on purpose");

namespace {

const std::vector<std::string> kFlags = {"config",        "listen",   "metrics_listen",
                                         "health_listen", "insecure", "log_format",
                                         "fault_inject"};

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd",
      .summary = "GPU-resident KV-cache daemon",
      .files = {__FILE__},
      .commands = {{.name = "serve",
                    .synopsis =
                        "[--config FILE] [--listen HOST:PORT] [--metrics-listen HOST:PORT]\n"
                        "    [--health-listen HOST:PORT] [--insecure] [--log-format text|json]\n"
                        "    [--fault-inject SPEC]",
                    .description =
                        R"(start the daemon
Without --config it serves the built-in profiles 'qwen3-8b' (1 GiB) and 'tiny'
(1 MiB) on 127.0.0.1:50051, with metrics on 127.0.0.1:9464. Flags override the
config file. When ready it prints one line to stdout:
  kvcd ready grpc=HOST:PORT metrics=HOST:PORT health=HOST:PORT
SIGTERM/SIGINT drain it: health turns NOT_SERVING, new calls get UNAVAILABLE,
calls in flight finish, then it exits 0. The log goes to stderr, one line per
event with its time and level (--log-format json: one JSON object per line).
A non-loopback --listen/listen needs TLS (tls.cert_file, tls.key_file) and bearer
tokens (auth.tokens_file); --insecure serves it without them.
--fault-inject SPEC: server/backends/fault_injector.h.)",
                    .flags = kFlags},
                   {.name = "check-config",
                    .synopsis = "--config FILE [flags]",
                    .description = R"(validate a config file (and its TLS and tokens files)
Prints what the daemon would serve with it and the flags given.)",
                    .flags = kFlags}},
      .notes = "Configuration keys are documented in docs/operating.md (\"Configuration\").\n"};
  return program;
}

int Fail(const std::string& msg) {
  std::fprintf(stderr, "kvcd: %s\n", msg.c_str());
  return 2;
}

// A failure of `serve` after the command line was read: one ERROR line in the log.
int FailServe(const absl::Status& s) {
  KVCD_LOG(ERROR) << s.message();
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(Cli(), argc, argv);
  const std::string cmd = cli.command->name;
  if (absl::Status s = kvcd::log::SetFormat(absl::GetFlag(FLAGS_log_format)); !s.ok()) {
    return kvcd::cli::UsageError(Cli(), cli.command, s.message());
  }
  const std::string config_path = absl::GetFlag(FLAGS_config);
  const std::string listen = absl::GetFlag(FLAGS_listen);
  kvcd::ServerConfig config;
  if (!config_path.empty()) {
    auto loaded = kvcd::LoadConfigFile(config_path);
    if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
    config = *loaded;
  } else if (cmd == "check-config") {
    return kvcd::cli::UsageError(Cli(), cli.command, "check-config needs --config FILE");
  } else {
    config.memory_budget_bytes = (1ull << 30) + (1ull << 20);
    config.models = {*kvcd::BuiltinModelSpec("qwen3-8b"), *kvcd::BuiltinModelSpec("tiny")};
  }
  if (!listen.empty()) config.listen = listen;
  if (cli.Given("metrics_listen")) config.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (cli.Given("health_listen")) config.health_listen = absl::GetFlag(FLAGS_health_listen);
  config.insecure = absl::GetFlag(FLAGS_insecure);
  config.fault_inject = absl::GetFlag(FLAGS_fault_inject);

  if (cmd == "check-config") {
    if (absl::Status s = kvcd::CheckExposure(config); !s.ok())
      return Fail(std::string(s.message()));
    if (absl::Status s = kvcd::CheckMetricsExposure(config); !s.ok())
      return Fail(std::string(s.message()));
    if (absl::Status s = kvcd::CheckModelCodecs(config); !s.ok()) {
      return Fail(std::string(s.message()));
    }
    if (config.tls.enabled()) {
      if (absl::Status s = kvcd::CheckTlsFiles(config.tls); !s.ok()) {
        return Fail(std::string(s.message()));
      }
    }
    if (config.auth.enabled()) {
      auto tokens = kvcd::TokenStore::Load(config.auth.tokens_file);
      if (!tokens.ok()) return Fail(std::string(tokens.status().message()));
      std::printf("auth: %zu token(s) in %s\n", (*tokens)->current()->size(),
                  config.auth.tokens_file.c_str());
    }
    std::printf("config OK: listen %s, backend %s, budget %llu bytes, %zu model(s)\n",
                config.listen.c_str(), config.backend.c_str(),
                static_cast<unsigned long long>(config.memory_budget_bytes), config.models.size());
    for (const auto& m : config.models) {
      std::printf(
          "  %s: %d layers, %d q / %d kv heads, head_dim %d, page %d, history %s, %llu bytes\n",
          m.name.c_str(), m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim, m.page_size,
          kvcd::FormatName(m.history_format), static_cast<unsigned long long>(m.memory_bytes));
    }
    return 0;
  }

  // Signals are handled by one thread through sigwait; block them everywhere else.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  kvcd::InstallRateLimitedProtobufLog();  // invalid UTF-8 in requests must not flood the log
  kvcd::InstallRateLimitedGrpcLog();      // nor handshakes that fail in a loop
  auto daemon = kvcd::Daemon::Start(config);
  if (!daemon.ok()) return FailServe(daemon.status());
  KVCD_LOG(INFO) << "kvcd " << KVCD_VERSION << " (commit " << KVCD_COMMIT << "): backend "
                 << config.backend << " (cpu isa "
                 << kvcd::kernels::CpuIsaName(kvcd::kernels::ActiveCpuIsa()) << "), "
                 << config.models.size() << " model(s), budget " << config.memory_budget_bytes
                 << " bytes";
  std::printf("kvcd ready grpc=%s metrics=%s health=%s\n", (*daemon)->grpc_address().c_str(),
              (*daemon)->metrics_address().empty() ? "off" : (*daemon)->metrics_address().c_str(),
              (*daemon)->health_address().empty() ? (*daemon)->grpc_address().c_str()
                                                  : (*daemon)->health_address().c_str());
  std::fflush(stdout);

  kvcd::Daemon* raw = daemon->get();
  std::thread signal_thread([raw, signals] {
    int sig = 0;
    sigwait(&signals, &sig);
    KVCD_LOG(INFO) << "signal " << sig << ", draining";
    raw->Drain();
  });
  raw->Wait();
  signal_thread.detach();  // still in sigwait if the backend failed
  const bool fatal = raw->fatal();
  if (fatal) {
    KVCD_LOG(ERROR) << "backend failed, exiting with status 1";
  } else {
    KVCD_LOG(INFO) << "drained, exiting";
  }
  std::fflush(nullptr);
  // Every RPC has finished. Skip the remaining destructors: the metrics exposer's web
  // server (civetweb) alone takes seconds to stop, and the pools are only memory.
  std::_Exit(fatal ? 1 : 0);
}
