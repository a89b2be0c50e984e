#include "server/cluster/block_index.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace kvcd {
namespace {

using Clock = std::chrono::steady_clock;

bool IsHexIncarnation(const std::string& s) {
  if (s.size() != 16) return false;
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string RedisHostPort(const std::string& url, int* port) {
  std::string host;
  if (!ParseRedisUrl(url, &host, port).ok()) *port = 0;  // checked by ParseConfig already
  return host;
}

}  // namespace

BlockIndex::BlockIndex(Options options)
    : o_(std::move(options)),
      prefix_("kvcd:{" + o_.cluster.name + "}:"),
      field_value_(o_.incarnation + ":" + o_.tier),
      redis_(
          [&] {
            int port = 0;
            return RedisHostPort(o_.cluster.redis_url, &port);
          }(),
          [&] {
            int port = 0;
            RedisHostPort(o_.cluster.redis_url, &port);
            return port;
          }(),
          std::chrono::milliseconds(1000)) {}

BlockIndex::~BlockIndex() { Stop(); }

std::string BlockIndex::BlockKey(const std::string& hash_hex) const {
  return prefix_ + "blk:" + hash_hex;
}
std::string BlockIndex::HeldKey(const std::string& member_id, const std::string& inc) const {
  return prefix_ + "held:" + member_id + ":" + inc;
}
std::string BlockIndex::LoadKey(const std::string& member_id) const {
  return prefix_ + "load:" + member_id;
}
std::string BlockIndex::EpochKey() const { return prefix_ + "epoch"; }
std::string BlockIndex::PurgeKey(const std::string& member_id, const std::string& inc) const {
  return prefix_ + "purge:" + member_id + ":" + inc;
}

void BlockIndex::Start() {
  writer_ = std::thread([this] { WriterLoop(); });
}

void BlockIndex::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

void BlockIndex::Enqueue(std::vector<Change> changes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!advertised_) {
    dirty_ = true;  // published when advertised
    return;
  }
  if (queue_.size() + changes.size() > kMaxQueued) {
    errors_.fetch_add(1);
    dirty_ = true;  // the writer is behind: republish instead of queueing without bound
    return;
  }
  for (Change& c : changes) queue_.push_back(std::move(c));
  cv_.notify_all();
}

void BlockIndex::BlocksStored(const BlockNamespace&, std::vector<StoredBlock> blocks) {
  const auto now = Clock::now();
  std::vector<Change> changes;
  changes.reserve(blocks.size());
  for (const StoredBlock& b : blocks) changes.push_back({true, BlockHashHex(b.hash), now});
  Enqueue(std::move(changes));
}

void BlockIndex::BlocksRemoved(const BlockNamespace&, std::vector<BlockHash> hashes) {
  const auto now = Clock::now();
  std::vector<Change> changes;
  changes.reserve(hashes.size());
  for (const BlockHash& h : hashes) changes.push_back({false, BlockHashHex(h), now});
  Enqueue(std::move(changes));
}

void BlockIndex::SetAdvertised(bool advertised) {
  std::lock_guard<std::mutex> lock(mu_);
  advertised_ = advertised;
  if (!advertised) {
    // Not a member now: write nothing. Peers may purge what this member wrote, so all of
    // it is published again once advertised.
    queue_.clear();
    dirty_ = true;
  }
  cv_.notify_all();
}

void BlockIndex::PurgeMember(const MemberInfo& gone) {
  std::lock_guard<std::mutex> lock(mu_);
  purges_pending_.push_back({gone.member_id, gone.incarnation});
  cv_.notify_all();
}

void BlockIndex::WriterLoop() {
  const auto interval = std::chrono::milliseconds(o_.cluster.load_interval_ms);
  auto next_periodic = Clock::now();
  bool logged = false;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, next_periodic, [&] {
        return stopping_ || (advertised_ && !queue_.empty()) || !purges_pending_.empty();
      });
      if (stopping_) return;
    }
    const bool periodic = Clock::now() >= next_periodic;
    if (periodic) next_periodic = Clock::now() + interval;
    if (WriteOnce(periodic)) {
      if (logged)
        KVCD_LOG(INFO) << "cluster: the block index on " << o_.cluster.redis_url
                       << " answers again";
      logged = false;
      continue;
    }
    errors_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      dirty_ = true;
    }
    if (!logged) {
      KVCD_LOG(WARNING) << "cluster: writing the block index on " << o_.cluster.redis_url
                        << " failed; retrying (the index is republished when it answers)";
      logged = true;
    }
    // Back off until the next periodic pass (or a stop).
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, next_periodic, [&] { return stopping_; });
    if (stopping_) return;
  }
}

bool BlockIndex::WriteOnce(bool periodic) {
  if (!started_clean_) {
    if (!PurgeOwnPrevious()) return false;
    started_clean_ = true;
  }
  std::vector<Purge> purges;
  {
    std::lock_guard<std::mutex> lock(mu_);
    purges.swap(purges_pending_);
  }
  for (size_t i = 0; i < purges.size(); ++i) {
    if (!PurgeIncarnation(purges[i])) {
      std::lock_guard<std::mutex> lock(mu_);
      purges_pending_.insert(purges_pending_.end(), purges.begin() + i, purges.end());
      return false;
    }
  }
  bool advertised = false;
  if (periodic) {
    if (!CheckEpoch()) return false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      advertised = advertised_;
    }
    if (advertised && !WriteLoad()) return false;
  }
  bool republish = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!advertised_) {
      queue_.clear();
      return true;
    }
    republish = dirty_;
    dirty_ = false;
  }
  if (republish) Republish();
  while (true) {
    std::vector<Change> batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ || !advertised_) return true;
      while (!queue_.empty() && batch.size() < kBatch) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    if (batch.empty()) return true;
    if (!WriteBatch(std::move(batch))) return false;
  }
}

bool BlockIndex::WriteBatch(std::vector<Change> batch) {
  std::vector<std::vector<std::string>> cmds;
  cmds.reserve(2 * batch.size());
  const std::string held = HeldKey(o_.member_id, o_.incarnation);
  for (const Change& c : batch) {
    if (c.stored) {
      cmds.push_back({"HSET", BlockKey(c.hash_hex), o_.member_id, field_value_});
      cmds.push_back({"SADD", held, c.hash_hex});
    } else {
      cmds.push_back({"HDEL", BlockKey(c.hash_hex), o_.member_id});
      cmds.push_back({"SREM", held, c.hash_hex});
    }
  }
  absl::StatusOr<std::vector<RedisReply>> r = redis_.Pipeline(cmds);
  if (!r.ok()) {
    errors_.fetch_add(batch.size());
    return false;
  }
  uint64_t refused = 0;
  for (const RedisReply& reply : *r) refused += reply.is_error() ? 1 : 0;
  errors_.fetch_add(refused);
  writes_.fetch_add(batch.size());
  lag_ms_.store(
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - batch.front().queued)
          .count());
  return true;
}

bool BlockIndex::CheckEpoch() {
  absl::StatusOr<RedisReply> r = redis_.Command({"GET", EpochKey()});
  if (!r.ok()) return false;
  if (r->type == RedisReply::Type::kNil) {
    // Redis is empty (new, or restarted without its data): this daemon may be the first to
    // notice. SET NX: of several daemons one sets it and all read the same value.
    absl::StatusOr<RedisReply> set =
        redis_.Command({"SET", EpochKey(), NewIncarnation() + NewIncarnation(), "NX"});
    if (!set.ok()) return false;
    r = redis_.Command({"GET", EpochKey()});
    if (!r.ok()) return false;
  }
  if (r->type != RedisReply::Type::kString || r->str.empty() || r->str.size() > 64) {
    KVCD_LOG(WARNING) << "cluster: the index's epoch key holds no valid epoch (a string of 1..64 "
                         "bytes); ignoring it";
    return true;
  }
  if (epoch_.empty()) {
    epoch_ = r->str;
    return true;
  }
  if (r->str != epoch_) {
    KVCD_LOG(WARNING) << "cluster: the index's epoch changed (Redis restarted empty); "
                         "republishing every page held";
    epoch_ = r->str;
    std::lock_guard<std::mutex> lock(mu_);
    dirty_ = true;
  }
  return true;
}

bool BlockIndex::WriteLoad() {
  const Load l = o_.load ? o_.load() : Load{};
  const std::string key = LoadKey(o_.member_id);
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  absl::StatusOr<std::vector<RedisReply>> r = redis_.Pipeline(
      {{"HSET", key, "incarnation", o_.incarnation, "pages_used", std::to_string(l.pages_used),
        "pages_capacity", std::to_string(l.pages_capacity), "open_sequences",
        std::to_string(l.open_sequences), "queued_decode", std::to_string(l.queued_decode),
        "updated_ms", std::to_string(now_ms)},
       {"PEXPIRE", key, std::to_string(3 * o_.cluster.load_interval_ms)}});
  return r.ok();
}

void BlockIndex::Republish() {
  republishes_.fetch_add(1);
  const auto t0 = Clock::now();
  if (o_.replay) o_.replay();  // BlocksStored for every page: queued behind what is there
  size_t queued = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued = queue_.size();
  }
  KVCD_LOG(INFO) << "cluster: republishing " << queued << " block change(s) to the index ("
                 << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()
                 << " ms to list them)";
}

bool BlockIndex::PurgeOwnPrevious() {
  const std::string pattern = HeldKey(o_.member_id, "*");
  const std::string head = HeldKey(o_.member_id, "");
  std::string cursor = "0";
  std::vector<std::string> previous;
  for (int round = 0; round < 10000; ++round) {
    absl::StatusOr<RedisReply> r =
        redis_.Command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
    if (!r.ok()) return false;
    if (r->type != RedisReply::Type::kArray || r->elements.size() != 2 ||
        r->elements[0].type != RedisReply::Type::kString ||
        r->elements[1].type != RedisReply::Type::kArray) {
      KVCD_LOG(WARNING) << "cluster: unexpected SCAN reply from the index; skipping the purge of "
                           "this member's previous incarnations";
      return true;
    }
    for (const RedisReply& k : r->elements[1].elements) {
      if (k.type != RedisReply::Type::kString || k.str.size() != head.size() + 16 ||
          k.str.compare(0, head.size(), head) != 0) {
        continue;
      }
      const std::string inc = k.str.substr(head.size());
      if (IsHexIncarnation(inc) && inc != o_.incarnation) previous.push_back(inc);
    }
    cursor = r->elements[0].str;
    if (cursor == "0") break;
  }
  for (const std::string& inc : previous) {
    if (!PurgeIncarnation({o_.member_id, inc})) return false;
  }
  return true;
}

bool BlockIndex::PurgeIncarnation(const Purge& p) {
  if (!IsValidMemberId(p.member_id) || !IsHexIncarnation(p.incarnation)) return true;
  if (o_.is_member) {
    MemberInfo m;
    m.member_id = p.member_id;
    m.incarnation = p.incarnation;
    if (o_.is_member(m)) return true;  // back under a new lease: its entries are live
  }
  absl::StatusOr<RedisReply> lock = redis_.Command(
      {"SET", PurgeKey(p.member_id, p.incarnation), o_.member_id, "NX", "PX", "60000"});
  if (!lock.ok()) return false;
  if (lock->type != RedisReply::Type::kStatus) return true;  // another member purges it
  const std::string held = HeldKey(p.member_id, p.incarnation);
  const std::string mine = p.incarnation + ":";
  std::string cursor = "0";
  uint64_t removed = 0;
  for (int round = 0; round < 100000; ++round) {
    absl::StatusOr<RedisReply> r = redis_.Command({"SSCAN", held, cursor, "COUNT", "1000"});
    if (!r.ok()) return false;
    if (r->type != RedisReply::Type::kArray || r->elements.size() != 2 ||
        r->elements[0].type != RedisReply::Type::kString ||
        r->elements[1].type != RedisReply::Type::kArray) {
      break;
    }
    std::vector<std::string> hashes;
    for (const RedisReply& e : r->elements[1].elements) {
      if (e.type == RedisReply::Type::kString && ParseBlockHashHex(e.str).ok()) {
        hashes.push_back(e.str);
      }
    }
    if (!hashes.empty()) {
      // Only the fields that still carry that incarnation: a restarted member may have
      // written the same hash again under its new one.
      std::vector<std::vector<std::string>> gets;
      for (const std::string& h : hashes) gets.push_back({"HGET", BlockKey(h), p.member_id});
      absl::StatusOr<std::vector<RedisReply>> values = redis_.Pipeline(gets);
      if (!values.ok()) return false;
      std::vector<std::vector<std::string>> dels;
      for (size_t i = 0; i < hashes.size(); ++i) {
        const RedisReply& v = (*values)[i];
        if (v.type == RedisReply::Type::kString && v.str.compare(0, mine.size(), mine) == 0) {
          dels.push_back({"HDEL", BlockKey(hashes[i]), p.member_id});
        }
      }
      if (!dels.empty()) {
        if (!redis_.Pipeline(dels).ok()) return false;
        removed += dels.size();
      }
    }
    cursor = r->elements[0].str;
    if (cursor == "0") break;
  }
  if (!redis_.Command({"DEL", held}).ok()) return false;
  purges_.fetch_add(1);
  KVCD_LOG(INFO) << "cluster: purged " << removed << " index entr" << (removed == 1 ? "y" : "ies")
                 << " of " << p.member_id << " (incarnation " << p.incarnation << ")";
  return true;
}

}  // namespace kvcd
