// Integration: TLS, mutual TLS, the token and certificate files' reloads and the start-up
// safety rule, through the real kvcd binary on loopback (the fixture, security_fixture.h,
// makes the certificates with the openssl CLI). Tenant authorization: tenant_auth_test.cc.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "client/client.h"
#include "daemon_process.h"
#include "security_fixture.h"

namespace kvcd {
namespace security_test {

using security_fixture::Path;
using security_fixture::SecurityTest;
using security_fixture::TokenEntry;
using security_fixture::WriteFile;
using testing_util::DaemonProcess;
using testing_util::ReadFile;
using testing_util::WaitFor;
using Clock = std::chrono::steady_clock;

TEST_F(SecurityTest, TlsIsAcceptedAndPlaintextOrAnUntrustedCaIsRefused) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start(Config(TlsBlock(false))));
  ClientOptions o = Options(d);
  o.tls_root_ca_file = Path("ca.pem");
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto stats = (*c)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();

  ClientOptions plain = RefusedOptions(d);
  auto p = Client::Connect(plain);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable) << p.status();

  ClientOptions other = RefusedOptions(d);
  other.tls_root_ca_file = Path("otherca.pem");
  auto u = Client::Connect(other);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kUnavailable) << u.status();

  // Kubelet probes: the health-only port stays plaintext.
  ClientOptions health;
  health.target = d.health();
  auto h = Client::Connect(health);
  ASSERT_TRUE(h.ok()) << h.status();
  auto serving = (*h)->Health();
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_EQ(*serving, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(d.Stop(), 0);
}

TEST_F(SecurityTest, MutualTlsRequiresAClientCertificateFromTheConfiguredCa) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start(Config(TlsBlock(true))));
  ClientOptions o = Options(d);
  o.tls_root_ca_file = Path("ca.pem");
  ClientOptions refused = RefusedOptions(d);
  refused.tls_root_ca_file = Path("ca.pem");
  auto without = Client::Connect(refused);
  EXPECT_EQ(without.status().code(), absl::StatusCode::kUnavailable) << without.status();

  ClientOptions rogue = refused;  // a certificate from a CA the daemon does not trust
  rogue.tls_client_cert_file = Path("rogue.pem");
  rogue.tls_client_key_file = Path("rogue.key");
  auto r = Client::Connect(rogue);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();

  o.tls_client_cert_file = Path("client.pem");
  o.tls_client_key_file = Path("client.key");
  auto with = Client::Connect(o);
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_TRUE((*with)->Stats().ok());
}

TEST_F(SecurityTest, TokenFileReloadAddsRevokesAndSurvivesABrokenFile) {
  const std::string tokens = Path("reload-tokens.yaml");
  const std::string entry_a = TokenEntry("a", "tok-a", "[t]");
  const std::string entry_b = TokenEntry("b", "tok-b", "[t]");
  WriteFile(tokens, "tokens:\n" + entry_a);
  DaemonProcess d;
  d.set_stderr_path(StderrPath());
  ASSERT_TRUE(d.Start(Config("auth: {tokens_file: " + tokens + ", reload_interval_ms: 50}\n")));
  auto client = [&](const std::string& token) {
    ClientOptions o = Options(d);
    o.token = token;
    return std::move(*Client::Connect(o));
  };
  auto a = client("tok-a");
  auto b = client("tok-b");
  ASSERT_TRUE(a->Stats().ok());
  EXPECT_EQ(b->Stats().status().code(), absl::StatusCode::kUnauthenticated);
  // A decode stream opened with a's token, and a request it may make (the sequence does
  // not exist: NOT_FOUND while the token is valid).
  auto stream = a->OpenDecodeStream();
  ASSERT_TRUE(stream.ok());
  v1::AttentionDecodeRequest probe;
  probe.add_sequence_ids(12345);
  EXPECT_EQ((*stream)->Call(probe).status().code(), absl::StatusCode::kNotFound);

  // Add b.
  WriteFile(tokens, "tokens:\n" + entry_a + entry_b);
  EXPECT_TRUE(WaitFor([&] { return b->Stats().ok(); }, std::chrono::seconds(10)));
  // Revoke a.
  WriteFile(tokens, "tokens:\n" + entry_b);
  EXPECT_TRUE(
      WaitFor([&] { return a->Stats().status().code() == absl::StatusCode::kUnauthenticated; },
              std::chrono::seconds(10)));
  // The open stream's next request is refused as well.
  EXPECT_EQ((*stream)->Call(probe).status().code(), absl::StatusCode::kUnauthenticated);
  // A broken file: logged, and b keeps working.
  WriteFile(tokens, "tokens:\n  - name: c\n    sha256: xyz\n");
  EXPECT_TRUE(
      WaitFor([&] { return ReadFile(StderrPath()).find("reload failed") != std::string::npos; },
              std::chrono::seconds(10)));
  const std::string log = ReadFile(StderrPath());
  EXPECT_NE(log.find(tokens), std::string::npos) << log;
  EXPECT_NE(log.find("keeping the previous 1 token(s)"), std::string::npos) << log;
  EXPECT_TRUE(b->Stats().ok());
  EXPECT_EQ(a->Stats().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(d.Stop(), 0);
}

TEST_F(SecurityTest, CertificateReloadTakesGoodFilesAndIgnoresBrokenOnes) {
  // The daemon reads copies of these files, so the test may break them in place.
  const std::string cert = Path("reload-server.pem"), key = Path("reload-server.key");
  WriteFile(cert, ReadFile(Path("server.pem")));
  WriteFile(key, ReadFile(Path("server.key")));
  DaemonProcess d;
  d.set_stderr_path(StderrPath());
  ASSERT_TRUE(d.Start(
      Config("tls: {cert_file: " + cert + ", key_file: " + key + ", reload_interval_s: 1}\n")));
  WriteFile(cert, "-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n");
  EXPECT_TRUE(WaitFor(
      [&] {
        return ReadFile(StderrPath()).find("keeping the previous credentials") != std::string::npos;
      },
      std::chrono::seconds(10)));
  EXPECT_NE(ReadFile(StderrPath()).find(cert), std::string::npos);
  // A new connection still gets the previous certificate (gRPC re-reads its copies
  // every second; give it two periods, checking all along).
  ClientOptions o = Options(d);
  o.tls_root_ca_file = Path("ca.pem");
  bool all_ok = true;
  const auto end = Clock::now() + std::chrono::milliseconds(2500);
  while (Clock::now() < end && all_ok) {
    auto c = Client::Connect(o);
    all_ok = c.ok() && (*c)->Stats().ok();
  }
  EXPECT_TRUE(all_ok);

  // A good new pair (from another CA) replaces it: clients trusting only that CA get in.
  WriteFile(key, ReadFile(Path("server2.key")));
  WriteFile(cert, ReadFile(Path("server2.pem")));
  ClientOptions next = Options(d);
  next.tls_root_ca_file = Path("otherca.pem");
  next.connect_timeout = std::chrono::milliseconds(500);
  EXPECT_TRUE(WaitFor(
      [&] {
        auto c = Client::Connect(next);
        return c.ok() && (*c)->Stats().ok();
      },
      std::chrono::seconds(15)));
  EXPECT_NE(ReadFile(StderrPath()).find("certificate files changed"), std::string::npos);
  o.connect_timeout = std::chrono::milliseconds(1000);
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(d.Stop(), 0);
}

TEST_F(SecurityTest, NonLoopbackWithoutTlsAndAuthIsRefusedUnlessInsecure) {
  DaemonProcess refused;
  refused.set_stderr_path(StderrPath());
  EXPECT_FALSE(refused.Start(Config("", "0.0.0.0:0")));
  EXPECT_EQ(refused.WaitExit(), 2);
  const std::string why = ReadFile(StderrPath());
  EXPECT_NE(why.find("refusing to serve on non-loopback address '0.0.0.0:0' without TLS and "
                     "authentication"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("auth.tokens_file"), std::string::npos) << why;

  // TLS alone is not enough.
  DaemonProcess tls_only;
  tls_only.set_stderr_path(StderrPath());
  EXPECT_FALSE(tls_only.Start(Config(TlsBlock(false), "0.0.0.0:0")));
  EXPECT_EQ(tls_only.WaitExit(), 2);
  EXPECT_NE(ReadFile(StderrPath()).find("without authentication"), std::string::npos);

  DaemonProcess insecure;
  insecure.set_stderr_path(StderrPath());
  insecure.set_extra_args({"--insecure"});
  ASSERT_TRUE(insecure.Start(Config("", "0.0.0.0:0")));
  const std::string warned = ReadFile(StderrPath());
  const size_t at = warned.find("--insecure: serving without TLS or authentication");
  ASSERT_NE(at, std::string::npos) << warned;
  const size_t line = warned.rfind('\n', at) + 1;  // npos + 1 == 0 on the first line
  EXPECT_NE(warned.substr(line, at - line).find(" WARNING "), std::string::npos) << warned;
  ClientOptions o;
  o.target = "127.0.0.1:" + insecure.grpc().substr(insecure.grpc().rfind(':') + 1);
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->Stats().ok());
  EXPECT_EQ(insecure.Stop(), 0);

  // With TLS and auth a non-loopback address is served.
  const std::string tokens = Path("exposed-tokens.yaml");
  WriteFile(tokens, "tokens:\n" + TokenEntry("a", "tok-a", "[t]"));
  DaemonProcess secured;
  ASSERT_TRUE(secured.Start(
      Config(TlsBlock(false) + "auth: {tokens_file: " + tokens + "}\n", "0.0.0.0:0")));
  ClientOptions so;
  so.target = "127.0.0.1:" + secured.grpc().substr(secured.grpc().rfind(':') + 1);
  so.tls_root_ca_file = Path("ca.pem");
  so.token = "tok-a";
  auto sc = Client::Connect(so);
  ASSERT_TRUE(sc.ok()) << sc.status();
  EXPECT_TRUE((*sc)->Stats().ok());
}

TEST_F(SecurityTest, BadCredentialFilesFailStartUpNamingTheFile) {
  const std::string bad_tokens = Path("bad-tokens.yaml");
  WriteFile(bad_tokens, "tokens:\n  - {name: x, sha256: 12, tenants: [t]}\n");
  struct Case {
    std::string extra;
    std::string expect;  // in the error, besides the file's path
    std::string file;
  };
  const Case cases[] = {
      {"tls: {cert_file: " + Path("garbage.pem") + ", key_file: " + Path("server.key") + "}\n",
       "holds no PEM certificate", Path("garbage.pem")},
      {"tls: {cert_file: " + Path("server.pem") + ", key_file: " + Path("missing.key") + "}\n",
       "cannot read tls.key_file", Path("missing.key")},
      {"tls: {cert_file: " + Path("server.pem") + ", key_file: " + Path("client.key") + "}\n",
       "is not the private key of the certificate", Path("client.key")},
      {"tls: {cert_file: " + Path("server.pem") + ", key_file: " + Path("server.key") +
           ", client_ca_file: " + Path("garbage.pem") + "}\n",
       "tls.client_ca_file", Path("garbage.pem")},
      {"auth: {tokens_file: " + bad_tokens + "}\n", "expected 64 hex digits", bad_tokens},
      {"auth: {tokens_file: " + Path("missing.yaml") + "}\n", "cannot read auth.tokens_file",
       Path("missing.yaml")},
  };
  for (const Case& c : cases) {
    DaemonProcess d;
    d.set_stderr_path(StderrPath());
    EXPECT_FALSE(d.Start(Config(c.extra))) << c.extra;
    EXPECT_EQ(d.WaitExit(), 2) << c.extra;
    const std::string err = ReadFile(StderrPath());
    EXPECT_NE(err.find(c.expect), std::string::npos) << err;
    EXPECT_NE(err.find(c.file), std::string::npos) << err;
  }
}

}  // namespace security_test
}  // namespace kvcd
