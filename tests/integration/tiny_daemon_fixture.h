// The fixture the daemon's integration tests share: the real kvcd binary started on a test
// file's config (which registers the builtin "tiny" model), a client connected to it and the
// tiny model's profile.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "client/client.h"
#include "daemon_process.h"

namespace kvcd::testing_util {

// The daemon tests' config: loopback ports, a 16 MiB budget, short leases and drain, the
// builtin "tiny" model in 1 MiB; a test file appends its own models after it.
inline constexpr char kTinyDaemonConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
health_listen: 127.0.0.1:0
memory_budget: 16MiB
lease: {default_ms: 40, max_ms: 60000}
drain_timeout_ms: 300
models:
  - builtin: tiny
    memory: 1MiB
)";

class TinyDaemonTest : public ::testing::Test {
 protected:
  // Starts the daemon on `config`, then Connect()s.
  void StartDaemon(const std::string& config) {
    ASSERT_TRUE(daemon_.Start(config));
    Connect();
  }

  // A client for the running daemon (10 s deadlines), and the profile of its "tiny" model.
  void Connect() {
    ClientOptions o;
    o.target = daemon_.grpc();
    o.deadline = std::chrono::milliseconds(10000);
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    auto m = client_->GetModel("tiny");
    ASSERT_TRUE(m.ok()) << m.status();
    profile_ = m->profile();
  }

  DaemonProcess daemon_;
  std::unique_ptr<Client> client_;
  v1::ModelProfile profile_;
};

}  // namespace kvcd::testing_util
