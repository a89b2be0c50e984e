// kvcd: the KV-cache daemon.
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "kvcd/kernels/cpu_features.h"
#include "server/config/config.h"
#include "server/daemon/daemon.h"
#include "server/daemon/protobuf_log.h"
#include "server/rpc/auth.h"
#include "server/rpc/tls.h"

namespace {

constexpr char kUsage[] = R"(kvcd — GPU-resident KV-cache daemon (CPU backend in this build)

Usage:
  kvcd serve [--config FILE] [--listen HOST:PORT] [--metrics-listen HOST:PORT]
             [--health-listen HOST:PORT] [--insecure] [--fault-inject SPEC]
  kvcd check-config --config FILE
  kvcd --version | --help

serve         Start the daemon. Without --config it serves the built-in profiles
              'qwen3-8b' (1 GiB) and 'tiny' (1 MiB) on 127.0.0.1:50051, with
              metrics on 127.0.0.1:9464. Flags override the config file.
              When ready it prints one line to stdout:
                kvcd ready grpc=HOST:PORT metrics=HOST:PORT health=HOST:PORT
              SIGTERM/SIGINT drain it: health turns NOT_SERVING, new calls get
              UNAVAILABLE, calls in flight finish, then it exits 0.
              A non-loopback --listen/listen needs TLS (tls.cert_file, tls.key_file)
              and bearer tokens (auth.tokens_file); --insecure serves it without
              them (logged as a warning; never on an untrusted network).
              --fault-inject (tests only) makes the backend fail on purpose:
              SPEC is alloc:N, copy:N, attend:N or sticky:KIND:N, comma-separated
              (server/backends/fault_injector.h).
check-config  Validate a config file (and its TLS and tokens files) and print
              what it would serve.

Configuration keys are documented in README.md ("Configuration").
)";

int Fail(const std::string& msg) {
  std::fprintf(stderr, "kvcd: %s\n", msg.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::printf("kvcd %s\n", KVCD_VERSION);
    return 0;
  }
  const std::string cmd = argv[1];
  if (cmd != "serve" && cmd != "check-config") {
    return Fail("unknown command '" + cmd + "'; run 'kvcd --help'");
  }
  std::string config_path, listen, metrics_listen, health_listen, fault_inject;
  bool have_metrics = false, have_health = false, insecure = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    bool ok = true;
    if (a == "--config") {
      ok = value(&config_path);
    } else if (a == "--listen") {
      ok = value(&listen);
    } else if (a == "--metrics-listen") {
      ok = value(&metrics_listen);
      have_metrics = true;
    } else if (a == "--insecure") {
      insecure = true;
    } else if (a == "--health-listen") {
      ok = value(&health_listen);
      have_health = true;
    } else if (a == "--fault-inject") {
      ok = value(&fault_inject);
    } else {
      return Fail("unknown flag '" + a + "'; run 'kvcd --help'");
    }
    if (!ok) return Fail("flag " + a + " needs a value");
  }
  kvcd::ServerConfig config;
  if (!config_path.empty()) {
    auto loaded = kvcd::LoadConfigFile(config_path);
    if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
    config = *loaded;
  } else if (cmd == "check-config") {
    return Fail("check-config needs --config FILE");
  } else {
    config.memory_budget_bytes = (1ull << 30) + (1ull << 20);
    config.models = {*kvcd::BuiltinModelSpec("qwen3-8b"), *kvcd::BuiltinModelSpec("tiny")};
  }
  if (!listen.empty()) config.listen = listen;
  if (have_metrics) config.metrics_listen = metrics_listen;
  if (have_health) config.health_listen = health_listen;
  config.insecure = insecure;
  config.fault_inject = fault_inject;

  if (cmd == "check-config") {
    if (absl::Status s = kvcd::CheckExposure(config); !s.ok())
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
  auto daemon = kvcd::Daemon::Start(config);
  if (!daemon.ok()) return Fail(std::string(daemon.status().message()));
  std::fprintf(stderr, "kvcd %s: backend %s (cpu isa %s), %zu model(s), budget %llu bytes\n",
               KVCD_VERSION, config.backend.c_str(),
               kvcd::kernels::CpuIsaName(kvcd::kernels::ActiveCpuIsa()), config.models.size(),
               static_cast<unsigned long long>(config.memory_budget_bytes));
  std::printf("kvcd ready grpc=%s metrics=%s health=%s\n", (*daemon)->grpc_address().c_str(),
              (*daemon)->metrics_address().empty() ? "off" : (*daemon)->metrics_address().c_str(),
              (*daemon)->health_address().empty() ? (*daemon)->grpc_address().c_str()
                                                  : (*daemon)->health_address().c_str());
  std::fflush(stdout);

  kvcd::Daemon* raw = daemon->get();
  std::thread signal_thread([raw, signals] {
    int sig = 0;
    sigwait(&signals, &sig);
    std::fprintf(stderr, "kvcd: signal %d, draining\n", sig);
    raw->Drain();
  });
  raw->Wait();
  signal_thread.detach();  // still in sigwait if the backend failed
  const bool fatal = raw->fatal();
  std::fprintf(
      stderr, fatal ? "kvcd: backend failed, exiting with status 1\n" : "kvcd: drained, exiting\n");
  std::fflush(nullptr);
  // Every RPC has finished. Skip the remaining destructors: the metrics exposer's web
  // server (civetweb) alone takes seconds to stop, and the pools are only memory.
  std::_Exit(fatal ? 1 : 0);
}
