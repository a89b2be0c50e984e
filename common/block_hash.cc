#include "common/block_hash.h"

#include <openssl/evp.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcd {
namespace {

constexpr char kDomain[] = "kvcd-block-v1";  // followed by one 0x00 byte in the hash input

void AppendU32le(std::string* out, uint32_t v) {
  const char b[4] = {static_cast<char>(v & 0xff), static_cast<char>((v >> 8) & 0xff),
                     static_cast<char>((v >> 16) & 0xff), static_cast<char>((v >> 24) & 0xff)};
  out->append(b, 4);
}

void AppendField(std::string* out, const std::string& s) {
  AppendU32le(out, static_cast<uint32_t>(s.size()));
  out->append(s);
}

// Everything before h_{i-1}: the same for every page of the namespace.
std::string NamespacePrefix(const BlockNamespace& ns) {
  std::string p(kDomain, sizeof(kDomain));  // sizeof counts the terminating 0x00
  AppendField(&p, ns.model);
  AppendField(&p, ns.salt);
  AppendField(&p, ns.format);
  return p;
}

// One EVP digest context per namespace, holding the prefix; each page continues a copy.
class PrefixDigest {
 public:
  explicit PrefixDigest(const BlockNamespace& ns) : ctx_(EVP_MD_CTX_new()) {
    const std::string prefix = NamespacePrefix(ns);
    if (ctx_ == nullptr || EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) != 1 ||
        EVP_DigestUpdate(ctx_, prefix.data(), prefix.size()) != 1) {
      std::abort();  // out of memory in OpenSSL: nothing sensible to name pages with
    }
  }
  ~PrefixDigest() { EVP_MD_CTX_free(ctx_); }
  PrefixDigest(const PrefixDigest&) = delete;
  PrefixDigest& operator=(const PrefixDigest&) = delete;

  BlockHash Page(uint32_t page_size, const BlockHash& parent, absl::Span<const int32_t> tokens) {
    std::string tail;
    tail.reserve(parent.size() + 4 + 4 * tokens.size());
    tail.append(reinterpret_cast<const char*>(parent.data()), parent.size());
    AppendU32le(&tail, page_size);
    for (const int32_t t : tokens) AppendU32le(&tail, static_cast<uint32_t>(t));
    EVP_MD_CTX* page = EVP_MD_CTX_new();
    BlockHash out;
    unsigned int len = 0;
    if (page == nullptr || EVP_MD_CTX_copy_ex(page, ctx_) != 1 ||
        EVP_DigestUpdate(page, tail.data(), tail.size()) != 1 ||
        EVP_DigestFinal_ex(page, out.data(), &len) != 1 || len != out.size()) {
      std::abort();
    }
    EVP_MD_CTX_free(page);
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

}  // namespace

BlockHash ChainBlockHash(const BlockNamespace& ns, const BlockHash& parent,
                         absl::Span<const int32_t> tokens) {
  return PrefixDigest(ns).Page(ns.page_size, parent, tokens);
}

std::vector<BlockHash> BlockHashes(const BlockNamespace& ns, absl::Span<const int32_t> tokens) {
  std::vector<BlockHash> out;
  if (ns.page_size == 0) return out;
  const size_t pages = tokens.size() / ns.page_size;
  out.reserve(pages);
  PrefixDigest prefix(ns);
  BlockHash parent = kRootBlockHash;
  for (size_t i = 0; i < pages; ++i) {
    parent = prefix.Page(ns.page_size, parent, tokens.subspan(i * ns.page_size, ns.page_size));
    out.push_back(parent);
  }
  return out;
}

std::string BlockHashHex(const BlockHash& h) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(64, '0');
  for (size_t i = 0; i < h.size(); ++i) {
    s[2 * i] = kDigits[h[i] >> 4];
    s[2 * i + 1] = kDigits[h[i] & 0xf];
  }
  return s;
}

absl::StatusOr<BlockHash> ParseBlockHashHex(absl::string_view hex) {
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("block hash: expected 64 hex digits, got ", hex.size(), " characters"));
  }
  BlockHash h;
  for (size_t i = 0; i < h.size(); ++i) {
    const int hi = nibble(hex[2 * i]);
    const int lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("block hash: expected 64 hex digits, found a non-hex character at offset ",
                       hi < 0 ? 2 * i : 2 * i + 1));
    }
    h[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return h;
}

int64_t BlockHashEventId(const BlockHash& h) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = v << 8 | h[i];
  int64_t s;
  std::memcpy(&s, &v, sizeof(s));  // two's complement reinterpretation
  return s;
}

}  // namespace kvcd
