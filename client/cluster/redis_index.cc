#include "client/cluster/redis_index.h"

#include <hiredis/hiredis.h>

#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace kvcd::cluster {
namespace {

const std::regex& ClusterNameRe() {
  static const auto* re = new std::regex("[A-Za-z0-9._-]{1,128}");
  return *re;
}

std::string Hex(const std::string& raw) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(raw.size() * 2);
  for (unsigned char c : raw) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

bool IsIncarnation(absl::string_view s) {
  if (s.size() != 16) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// A non-negative decimal integer below 2^63.
bool ParseCount(absl::string_view s, int64_t* out) {
  if (s.empty() || s.size() > 19) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return absl::SimpleAtoi(s, out) && *out >= 0;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

}  // namespace

absl::StatusOr<std::unique_ptr<RedisIndex>> RedisIndex::Connect(const std::string& url,
                                                                const std::string& cluster_name,
                                                                std::chrono::milliseconds timeout) {
  if (!std::regex_match(cluster_name, ClusterNameRe())) {
    return absl::InvalidArgumentError(absl::StrCat("cluster name \"", cluster_name.substr(0, 80),
                                                   "\" is not [A-Za-z0-9._-]{1,128}"));
  }
  absl::string_view rest(url);
  if (!absl::ConsumePrefix(&rest, "redis://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("redis url \"", url, "\" must be redis://host:port[/db]"));
  }
  int db = 0;
  const size_t slash = rest.find('/');
  if (slash != absl::string_view::npos) {
    if (!absl::SimpleAtoi(rest.substr(slash + 1), &db) || db < 0 || db > 1 << 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("redis url \"", url, "\": the database must be a number"));
    }
    rest = rest.substr(0, slash);
  }
  const size_t colon = rest.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(rest.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("redis url \"", url, "\" must be redis://host:port[/db], port 1..65535"));
  }
  std::unique_ptr<RedisIndex> index(new RedisIndex(std::string(rest.substr(0, colon)), port, db,
                                                   absl::StrCat("kvcd:{", cluster_name, "}:"),
                                                   timeout));
  std::lock_guard<std::mutex> lock(index->mu_);
  absl::Status s = index->EnsureConnected();
  if (!s.ok()) return s;
  return index;
}

RedisIndex::~RedisIndex() {
  if (ctx_ != nullptr) redisFree(ctx_);
}

absl::Status RedisIndex::EnsureConnected() {
  if (ctx_ != nullptr && ctx_->err == 0) return absl::OkStatus();
  if (ctx_ != nullptr) {
    redisFree(ctx_);
    ctx_ = nullptr;
  }
  timeval tv{static_cast<time_t>(timeout_.count() / 1000),
             static_cast<suseconds_t>((timeout_.count() % 1000) * 1000)};
  redisContext* c = redisConnectWithTimeout(host_.c_str(), port_, tv);
  if (c == nullptr || c->err != 0) {
    std::string why = c == nullptr ? "out of memory" : c->errstr;
    if (c != nullptr) redisFree(c);
    return absl::UnavailableError(
        absl::StrCat("redis at ", host_, ":", port_, " does not answer: ", why));
  }
  redisSetTimeout(c, tv);
  if (db_ != 0) {
    Reply r(static_cast<redisReply*>(redisCommand(c, "SELECT %d", db_)));
    if (r == nullptr || r->type == REDIS_REPLY_ERROR) {
      redisFree(c);
      return absl::UnavailableError(absl::StrCat("redis SELECT ", db_, " failed"));
    }
  }
  ctx_ = c;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<std::pair<std::string, std::string>>>> RedisIndex::HGetAll(
    const std::vector<std::string>& keys) {
  std::vector<std::vector<std::pair<std::string, std::string>>> out;
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::Status s = EnsureConnected();
    if (!s.ok()) return s;
    out.assign(keys.size(), {});
    for (const std::string& k : keys) {
      redisAppendCommand(ctx_, "HGETALL %b", k.data(), k.size());
    }
    bool broken = false;
    for (size_t i = 0; i < keys.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(ctx_, &raw) != REDIS_OK) {
        broken = true;
        break;
      }
      Reply r(static_cast<redisReply*>(raw));
      if (r->type != REDIS_REPLY_ARRAY || r->elements % 2 != 0) {
        ++rejected_;
        continue;
      }
      const size_t pairs = std::min(r->elements / 2, kMaxHoldersPerPage);
      if (r->elements / 2 > kMaxHoldersPerPage) ++rejected_;
      for (size_t j = 0; j < pairs; ++j) {
        const redisReply* f = r->element[2 * j];
        const redisReply* v = r->element[2 * j + 1];
        if (f->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING) {
          ++rejected_;
          continue;
        }
        out[i].emplace_back(std::string(f->str, f->len), std::string(v->str, v->len));
      }
    }
    if (!broken) return out;
    // The connection broke mid-pipeline: its remaining replies are lost; reconnect once.
    redisFree(ctx_);
    ctx_ = nullptr;
  }
  return absl::UnavailableError(
      absl::StrCat("redis at ", host_, ":", port_, " dropped the connection during a lookup"));
}

absl::StatusOr<std::vector<PageHolders>> RedisIndex::Holders(absl::Span<const std::string> hashes,
                                                             const Incarnations& members) {
  const size_t n = std::min(hashes.size(), kMaxLookupPages);
  std::vector<PageHolders> out(n);
  if (n == 0 || members.empty()) return out;
  std::vector<std::string> keys;
  keys.reserve(n);
  for (size_t i = 0; i < n; ++i) keys.push_back(absl::StrCat(prefix_, "blk:", Hex(hashes[i])));
  std::lock_guard<std::mutex> lock(mu_);
  auto replies = HGetAll(keys);
  if (!replies.ok()) return replies.status();
  for (size_t i = 0; i < n; ++i) {
    for (const auto& [member, value] : (*replies)[i]) {
      auto it = members.find(member);
      const size_t colon = value.find(':');
      absl::string_view inc = absl::string_view(value).substr(0, colon);
      absl::string_view tier =
          colon == std::string::npos ? "" : absl::string_view(value).substr(colon + 1);
      if (it == members.end() || !IsIncarnation(inc) || inc != it->second ||
          (tier != "device" && tier != "host")) {
        ++rejected_;
        continue;
      }
      out[i][member] = std::string(tier);
    }
  }
  return out;
}

absl::StatusOr<absl::flat_hash_map<std::string, Load>> RedisIndex::Loads(
    const Incarnations& members) {
  absl::flat_hash_map<std::string, Load> out;
  if (members.empty()) return out;
  std::vector<std::string> ids;
  std::vector<std::string> keys;
  for (const auto& [id, inc] : members) {
    ids.push_back(id);
    keys.push_back(absl::StrCat(prefix_, "load:", id));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto replies = HGetAll(keys);
  if (!replies.ok()) return replies.status();
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& fields = (*replies)[i];
    if (fields.empty()) continue;
    Load load;
    bool fenced = false, ok = true;
    for (const auto& [f, v] : fields) {
      if (f == "incarnation") {
        fenced = v == members.at(ids[i]);
      } else if (f == "pages_used") {
        ok &= ParseCount(v, &load.pages_used);
      } else if (f == "pages_capacity") {
        ok &= ParseCount(v, &load.pages_capacity);
      } else if (f == "open_sequences") {
        ok &= ParseCount(v, &load.open_sequences);
      } else if (f == "queued_decode") {
        ok &= ParseCount(v, &load.queued_decode);
      } else if (f == "updated_ms") {
        ok &= ParseCount(v, &load.updated_ms);
      }
    }
    if (!fenced || !ok) {
      ++rejected_;
      continue;
    }
    out[ids[i]] = load;
  }
  return out;
}

int64_t RedisIndex::rejected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rejected_;
}

}  // namespace kvcd::cluster
