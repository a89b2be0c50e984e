// The security tests' fixture (security_test.cc, tenant_auth_test.cc): a run's certificates
// made with the openssl CLI (a CA, server and client certificates, a CA nobody trusts), token
// files written as deployment tooling writes them, and a daemon's configuration and client
// options on loopback.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "client/client.h"
#include "daemon_process.h"

namespace kvcd {
namespace security_fixture {

using testing_util::DaemonProcess;
using testing_util::ReadFile;

inline std::string g_dir;  // certificates and token files of this test run

inline std::string Path(const std::string& name) { return g_dir + "/" + name; }

inline void WriteFile(const std::string& path, const std::string& text) {
  // Replaced through a rename, as deployment tooling (or a Kubernetes secret) does.
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << text;
  ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0);
}

inline std::string TokenHash(const std::string& token) {
  // The operator's way: printf %s "$TOKEN" | sha256sum.
  const std::string out = Path("hash.txt");
  const std::string cmd = "printf %s '" + token + "' | sha256sum | cut -c1-64 > " + out;
  if (std::system(cmd.c_str()) != 0) return "";
  std::string h = ReadFile(out);
  while (!h.empty() && (h.back() == '\n' || h.back() == ' ')) h.pop_back();
  return h;
}

inline std::string TokenEntry(const std::string& name, const std::string& token,
                              const std::string& tenants, bool reg = false, bool dp = false) {
  return "  - name: " + name + "\n    sha256: " + TokenHash(token) + "\n    tenants: " + tenants +
         "\n    register_models: " + (reg ? "true" : "false") +
         "\n    data_plane: " + (dp ? "true" : "false") + "\n";
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char dir[] = "/tmp/kvcd-security-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    g_dir = dir;
    // A CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a
    // second CA nobody trusts. EC P-256 keys: fast to make.
    const std::string script = "set -e; cd " + g_dir + R"(
      key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $1 2>/dev/null; }
      for ca in ca otherca; do
        key $ca.key
        openssl req -x509 -new -key $ca.key -out $ca.pem -days 2 -subj /CN=kvcd-test-$ca 2>/dev/null
      done
      printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > server.ext
      printf 'extendedKeyUsage=clientAuth\n' > client.ext
      for who in server:ca server2:otherca client:ca rogue:otherca; do
        n=${who%%:*}; ca=${who##*:}
        key $n.key
        openssl req -new -key $n.key -out $n.csr -subj /CN=kvcd-test-$n 2>/dev/null
        ext=client.ext; case $n in server*) ext=server.ext;; esac
        openssl x509 -req -in $n.csr -CA $ca.pem -CAkey $ca.key -CAcreateserial -out $n.pem \
          -days 2 -extfile $ext 2>/dev/null
      done
      printf 'not a certificate\n' > garbage.pem
    )";
    ASSERT_EQ(std::system(script.c_str()), 0) << "openssl failed in " << g_dir;
  }
  static void TearDownTestSuite() {
    if (!g_dir.empty()) std::system(("rm -rf " + g_dir).c_str());
  }

  static std::string Config(const std::string& extra, const std::string& listen = "127.0.0.1:0") {
    return "listen: " + listen + R"(
metrics_listen: ""
health_listen: 127.0.0.1:0
memory_budget: 4MiB
drain_timeout_ms: 300
models:
  - builtin: tiny
    memory: 1MiB
)" + extra;
  }

  static std::string TlsBlock(bool mutual) {
    return "tls:\n  cert_file: " + Path("server.pem") + "\n  key_file: " + Path("server.key") +
           "\n" + (mutual ? "  client_ca_file: " + Path("ca.pem") + "\n" : "");
  }

  static ClientOptions Options(const DaemonProcess& d) {
    ClientOptions o;
    o.target = d.grpc();
    o.deadline = std::chrono::milliseconds(10000);
    o.connect_timeout = std::chrono::milliseconds(3000);
    return o;
  }

  // For a connection the daemon must refuse: Connect waits out its whole connect_timeout
  // before it reports UNAVAILABLE, and an accepted handshake on loopback takes milliseconds,
  // so one second keeps the check meaningful without waiting three.
  static ClientOptions RefusedOptions(const DaemonProcess& d) {
    ClientOptions o = Options(d);
    o.connect_timeout = std::chrono::milliseconds(1000);
    return o;
  }

  std::string StderrPath() {
    const std::string p = Path(
        std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + ".stderr");
    return p;
  }
};

}  // namespace security_fixture
}  // namespace kvcd
