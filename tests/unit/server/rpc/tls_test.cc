// TLS file checks and the staging of credential files for gRPC's file watcher.
#include "server/rpc/tls.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "server/rpc/auth.h"

namespace kvcd {
namespace tls_test {

std::string g_dir;

std::string Path(const std::string& n) { return g_dir + "/" + n; }

std::string Read(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Write(const std::string& p, const std::string& text) {
  const std::string tmp = p + ".tmp";
  std::ofstream(tmp) << text;
  std::rename(tmp.c_str(), p.c_str());
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char dir[] = "/tmp/kvcd-tls-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    g_dir = dir;
    const std::string script = "set -e; cd " + g_dir + R"(
      for n in a b; do
        openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $n.key 2>/dev/null
        openssl req -x509 -new -key $n.key -out $n.pem -days 2 -subj /CN=kvcd-$n 2>/dev/null
      done
    )";
    ASSERT_EQ(std::system(script.c_str()), 0);
  }
  static void TearDownTestSuite() { std::system(("rm -rf " + g_dir).c_str()); }

  static TlsConfig Config(const std::string& cert, const std::string& key,
                          const std::string& ca = "") {
    TlsConfig t;
    t.cert_file = Path(cert);
    t.key_file = Path(key);
    if (!ca.empty()) t.client_ca_file = Path(ca);
    t.reload_interval_s = 1;
    return t;
  }
};

TEST_F(TlsTest, ChecksNameTheFileAndWhatWasExpected) {
  EXPECT_TRUE(CheckTlsFiles(Config("a.pem", "a.key")).ok());
  EXPECT_TRUE(CheckTlsFiles(Config("a.pem", "a.key", "b.pem")).ok());
  Write(Path("junk"), "hello\n");
  struct Case {
    TlsConfig tls;
    absl::StatusCode code;
    std::string expect;
  };
  const Case cases[] = {
      {Config("missing.pem", "a.key"), absl::StatusCode::kNotFound,
       "cannot read tls.cert_file '" + Path("missing.pem") + "'"},
      {Config("a.pem", "missing.key"), absl::StatusCode::kNotFound,
       "cannot read tls.key_file '" + Path("missing.key") + "'"},
      {Config("junk", "a.key"), absl::StatusCode::kInvalidArgument,
       "tls.cert_file '" + Path("junk") + "' holds no PEM certificate"},
      {Config("a.pem", "junk"), absl::StatusCode::kInvalidArgument,
       "tls.key_file '" + Path("junk") + "' holds no usable PEM private key"},
      {Config("a.pem", "b.key"), absl::StatusCode::kInvalidArgument,
       "tls.key_file '" + Path("b.key") + "' is not the private key of the certificate"},
      {Config("a.pem", "a.key", "junk"), absl::StatusCode::kInvalidArgument,
       "tls.client_ca_file '" + Path("junk") + "' holds no PEM certificate"},
      {Config("a.pem", "a.key", "missing-ca.pem"), absl::StatusCode::kNotFound,
       "cannot read tls.client_ca_file"},
  };
  for (const Case& c : cases) {
    absl::Status s = CheckTlsFiles(c.tls);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << s;
  }
}

TEST_F(TlsTest, OnlyFilesThatPassTheChecksReachTheStagedCopies) {
  Write(Path("live.pem"), Read(Path("a.pem")));
  Write(Path("live.key"), Read(Path("a.key")));
  auto src = TlsCredentialSource::Create(Config("live.pem", "live.key"));
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_NE((*src)->ServerCredentials(), nullptr);
  const std::string staged_dir = (*src)->staging_dir();
  ASSERT_FALSE(staged_dir.empty());
  struct stat st;
  ASSERT_EQ(stat(staged_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);  // private: it holds a copy of the key
  EXPECT_EQ(Read(staged_dir + "/cert.pem"), Read(Path("a.pem")));

  // A broken certificate: reported, the staged copies keep a's pair.
  Write(Path("live.pem"), "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
  std::string line;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (line.empty() && std::chrono::steady_clock::now() < end) {
    line = (*src)->Poll();
    if (line.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(line.find("keeping the previous credentials"), std::string::npos) << line;
  EXPECT_NE(line.find(Path("live.pem")), std::string::npos) << line;
  EXPECT_EQ(Read(staged_dir + "/cert.pem"), Read(Path("a.pem")));
  EXPECT_EQ(Read(staged_dir + "/key.pem"), Read(Path("a.key")));

  // b's pair passes and is staged.
  Write(Path("live.key"), Read(Path("b.key")));
  Write(Path("live.pem"), Read(Path("b.pem")));
  line.clear();
  const auto end2 = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (line.empty() && std::chrono::steady_clock::now() < end2) {
    line = (*src)->Poll();
    if (line.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(line.find("certificate files changed"), std::string::npos) << line;
  EXPECT_EQ(Read(staged_dir + "/cert.pem"), Read(Path("b.pem")));
  EXPECT_EQ(Read(staged_dir + "/key.pem"), Read(Path("b.key")));

  // The staging directory goes away with the source.
  src->reset();
  EXPECT_TRUE(Read(staged_dir + "/cert.pem").empty());
  EXPECT_NE(access(staged_dir.c_str(), F_OK), 0);
}

}  // namespace tls_test
}  // namespace kvcd
