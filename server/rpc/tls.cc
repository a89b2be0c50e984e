#include "server/rpc/tls.h"

#include <fcntl.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/rpc/auth.h"

namespace kvcd {
namespace {

struct TlsTexts {
  std::string cert, key, ca;
};

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no PEM block found";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

// The first PEM certificate of text (the caller frees it); INVALID_ARGUMENT naming the
// file if there is none.
absl::StatusOr<X509*> FirstCertificate(const std::string& text, const std::string& key,
                                       const std::string& path) {
  BIO* bio = BIO_new_mem_buf(text.data(), static_cast<int>(text.size()));
  X509* first = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  ERR_clear_error();
  BIO_free(bio);
  if (first == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        key, " '", path,
        "' holds no PEM certificate; expected one or more '-----BEGIN CERTIFICATE-----' "
        "blocks"));
  }
  return first;
}

absl::StatusOr<TlsTexts> ReadAndCheck(const TlsConfig& tls) {
  TlsTexts t;
  auto cert = ReadSmallFile(tls.cert_file, "tls.cert_file");
  if (!cert.ok()) return cert.status();
  auto key = ReadSmallFile(tls.key_file, "tls.key_file");
  if (!key.ok()) return key.status();
  t.cert = std::move(*cert);
  t.key = std::move(*key);
  auto x509 = FirstCertificate(t.cert, "tls.cert_file", tls.cert_file);
  if (!x509.ok()) return x509.status();
  BIO* bio = BIO_new_mem_buf(t.key.data(), static_cast<int>(t.key.size()));
  EVP_PKEY* pkey = PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  absl::Status status;
  if (pkey == nullptr) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "tls.key_file '", tls.key_file, "' holds no usable PEM private key (", OpenSslError(),
        "); expected an unencrypted '-----BEGIN PRIVATE KEY-----' block"));
  } else if (X509_check_private_key(*x509, pkey) != 1) {
    ERR_clear_error();
    status = absl::InvalidArgumentError(absl::StrCat(
        "tls.key_file '", tls.key_file,
        "' is not the private key of the certificate in tls.cert_file '", tls.cert_file, "'"));
  }
  EVP_PKEY_free(pkey);
  X509_free(*x509);
  if (!status.ok()) return status;
  if (!tls.client_ca_file.empty()) {
    auto ca = ReadSmallFile(tls.client_ca_file, "tls.client_ca_file");
    if (!ca.ok()) return ca.status();
    t.ca = std::move(*ca);
    auto ca509 = FirstCertificate(t.ca, "tls.client_ca_file", tls.client_ca_file);
    if (!ca509.ok()) return ca509.status();
    X509_free(*ca509);
  }
  return t;
}

// Writes path atomically (temporary file + rename), mode 0600.
absl::Status WriteFileAtomically(const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(e)));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

absl::Status CheckTlsFiles(const TlsConfig& tls) { return ReadAndCheck(tls).status(); }

absl::StatusOr<std::unique_ptr<TlsCredentialSource>> TlsCredentialSource::Create(
    const TlsConfig& tls) {
  std::unique_ptr<TlsCredentialSource> s(new TlsCredentialSource(tls));
  const char* tmpdir = std::getenv("TMPDIR");
  std::string templ =
      absl::StrCat(tmpdir != nullptr && *tmpdir ? tmpdir : "/tmp", "/kvcd-tls-XXXXXX");
  if (::mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create the TLS staging directory ", templ, ": ",
                                            std::strerror(errno)));
  }
  s->dir_ = templ;
  s->staged_ = tls;
  s->staged_.cert_file = s->dir_ + "/cert.pem";
  s->staged_.key_file = s->dir_ + "/key.pem";
  if (!tls.client_ca_file.empty()) s->staged_.client_ca_file = s->dir_ + "/client_ca.pem";
  std::lock_guard<std::mutex> lock(s->mu_);
  absl::Status st = s->Stage();
  if (!st.ok()) return st;
  s->next_check_ns_ = NowNs() + int64_t{tls.reload_interval_s} * 1000000000;
  return s;
}

TlsCredentialSource::~TlsCredentialSource() {
  if (dir_.empty()) return;
  for (const std::string* p : {&staged_.cert_file, &staged_.key_file, &staged_.client_ca_file}) {
    if (!p->empty()) ::unlink(p->c_str());
  }
  ::rmdir(dir_.c_str());
}

absl::Status TlsCredentialSource::Stage() {
  absl::StatusOr<TlsTexts> t = ReadAndCheck(tls_);
  if (!t.ok()) return t.status();
  last_ = Sha256Hex(t->cert + t->key + t->ca);
  // Key first: gRPC only takes a pair whose key matches the certificate.
  if (absl::Status s = WriteFileAtomically(staged_.key_file, t->key); !s.ok()) return s;
  if (absl::Status s = WriteFileAtomically(staged_.cert_file, t->cert); !s.ok()) return s;
  if (!tls_.client_ca_file.empty()) {
    if (absl::Status s = WriteFileAtomically(staged_.client_ca_file, t->ca); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> TlsCredentialSource::ServerCredentials() const {
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      staged_.key_file, staged_.cert_file, staged_.client_ca_file,
      static_cast<unsigned int>(tls_.reload_interval_s));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!tls_.client_ca_file.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::string TlsCredentialSource::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = NowNs();
  if (now < next_check_ns_) return "";
  next_check_ns_ = now + int64_t{tls_.reload_interval_s} * 1000000000;
  std::string fp;
  for (const std::string* p : {&tls_.cert_file, &tls_.key_file, &tls_.client_ca_file}) {
    if (p->empty()) continue;
    auto text = ReadSmallFile(*p, "file");
    fp += text.ok() ? *text : "\x01unreadable";
  }
  fp = Sha256Hex(fp);
  if (fp == last_) return "";
  absl::Status s = Stage();
  if (s.ok()) {
    return "tls: certificate files changed and passed the checks; new connections use them "
           "within tls.reload_interval_s";
  }
  last_ = fp;  // a broken state is reported once
  return absl::StrCat("tls: ", s.message(),
                      "; keeping the previous credentials until the files are fixed");
}

}  // namespace kvcd
