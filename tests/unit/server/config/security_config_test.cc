// The tls and auth configuration keys and the start-up exposure rule.
#include <gtest/gtest.h>

#include "server/config/config.h"

namespace kvcd {
namespace security_config_test {

TEST(SecurityConfigTest, ParsesTlsAndAuth) {
  auto c = ParseConfig(
      "tls: {cert_file: /c.pem, key_file: /k.pem, client_ca_file: /ca.pem, "
      "reload_interval_s: 2}\nauth: {tokens_file: /t.yaml, reload_interval_ms: 50}\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tls.cert_file, "/c.pem");
  EXPECT_EQ(c->tls.key_file, "/k.pem");
  EXPECT_EQ(c->tls.client_ca_file, "/ca.pem");
  EXPECT_EQ(c->tls.reload_interval_s, 2);
  EXPECT_TRUE(c->tls.enabled());
  EXPECT_EQ(c->auth.tokens_file, "/t.yaml");
  EXPECT_EQ(c->auth.reload_interval_ms, 50);
  EXPECT_FALSE(c->insecure);  // only the command-line flag sets it
}

TEST(SecurityConfigTest, RejectsIncompleteOrUnknownSettings) {
  struct Case {
    const char* yaml;
    const char* expect;
  };
  const Case cases[] = {
      {"tls: {cert_file: /c.pem}\n", "tls.cert_file and tls.key_file go together"},
      {"tls: {key_file: /k.pem}\n", "tls.cert_file and tls.key_file go together"},
      {"tls: {client_ca_file: /ca.pem}\n", "tls.client_ca_file (mutual TLS) needs"},
      {"tls: {cert_file: /c, key_file: /k, reload_interval_s: 0}\n",
       "tls.reload_interval_s is 0, expected 1..86400"},
      {"tls: {cert: /c}\n", "unknown key 'tls.cert'"},
      {"auth: {tokens: /t}\n", "unknown key 'auth.tokens'"},
      {"auth: {tokens_file: /t, reload_interval_ms: 1}\n", "auth.reload_interval_ms is 1"},
      {"insecure: true\n", "unknown key 'insecure'"},
  };
  for (const Case& k : cases) {
    auto c = ParseConfig(k.yaml);
    ASSERT_FALSE(c.ok()) << k.yaml;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << k.yaml;
    EXPECT_NE(c.status().message().find(k.expect), std::string::npos) << c.status();
  }
}

TEST(SecurityConfigTest, LoopbackAddresses) {
  for (const char* a : {"127.0.0.1:50051", "127.1.2.3:0", "localhost:1", "[::1]:50051",
                        "unix:/run/kvcd.sock", "[::ffff:127.0.0.1]:1"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a :
       {"0.0.0.0:50051", "[::]:50051", ":50051", "10.0.0.5:50051", "kvcd.internal:50051",
        "128.0.0.1:1", "localhost.evil.com:1",
        // Issue #35.8: a name that merely starts like a loopback address.
        "127.attacker.example:9464", "127.0.0.1.attacker.example:1", "[::ffff:10.0.0.1]:1"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

TEST(SecurityConfigTest, NonLoopbackNeedsTlsAndAuthUnlessInsecure) {
  ServerConfig c;
  EXPECT_TRUE(CheckExposure(c).ok());  // the default listen is loopback
  c.listen = "0.0.0.0:50051";
  absl::Status s = CheckExposure(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("without TLS and authentication"), std::string::npos) << s;
  EXPECT_NE(s.message().find("tls.cert_file"), std::string::npos) << s;
  EXPECT_NE(s.message().find("auth.tokens_file"), std::string::npos) << s;
  EXPECT_NE(s.message().find("--insecure"), std::string::npos) << s;
  c.tls.cert_file = "/c";
  c.tls.key_file = "/k";
  s = CheckExposure(c);
  EXPECT_NE(s.message().find("without authentication"), std::string::npos) << s;
  c.tls = TlsConfig();
  c.auth.tokens_file = "/t";
  s = CheckExposure(c);
  EXPECT_NE(s.message().find("without TLS:"), std::string::npos) << s;
  c.tls.cert_file = "/c";
  c.tls.key_file = "/k";
  EXPECT_TRUE(CheckExposure(c).ok());
  ServerConfig open;
  open.listen = "0.0.0.0:50051";
  open.insecure = true;
  EXPECT_TRUE(CheckExposure(open).ok());
}

// Issue #35.7: per-tenant metrics are opt-in, and only on a loopback metrics address.
TEST(SecurityConfigTest, PerTenantMetricsAreOptInAndLoopbackOnly) {
  absl::StatusOr<ServerConfig> c = ParseConfig("metrics_listen: 0.0.0.0:9464\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->metrics_per_tenant);  // off unless asked for
  EXPECT_TRUE(CheckMetricsExposure(*c).ok());
  c = ParseConfig("metrics_listen: 0.0.0.0:9464\nmetrics_per_tenant: true\n");
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status s = CheckMetricsExposure(*c);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("'0.0.0.0:9464'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("metrics_per_tenant: false"), std::string::npos) << s;
  c->metrics_listen = "127.0.0.1:9464";
  EXPECT_TRUE(CheckMetricsExposure(*c).ok());
  c->metrics_listen = "";  // no metrics at all
  EXPECT_TRUE(CheckMetricsExposure(*c).ok());
  EXPECT_EQ(ParseConfig("metrics_per_tenant: maybe\n").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace security_config_test
}  // namespace kvcd
