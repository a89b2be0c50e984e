// The block index on Redis (docs/cluster.md "Block index"): which member holds which page.
// The tree's changes arrive as a BlockObserver (on request threads, under a model's lock):
// they are queued, and one background thread writes them in pipelined batches, never on a
// request's path. A failed write raises the error count and marks the index dirty (the
// member republishes everything it holds once Redis answers again); it never fails a
// request. The same thread
//   - writes nothing while membership says this daemon is not advertised (a lost lease),
//     and republishes when it is advertised again;
//   - purges the entries of members that left (SET NX purge lock, then HDEL of the fields
//     still carrying that incarnation, then DEL of the member's held: set), and at start
//     its own previous incarnations;
//   - checks `epoch` every load interval (a Redis restarted empty: republish) and writes the
//     load: hash.
// Values read back from Redis are bounded and validated (redis_connection.h).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/cache/block_observer.h"
#include "server/cluster/member_info.h"
#include "server/cluster/redis_connection.h"
#include "server/config/config.h"

namespace kvcd {

class BlockIndex final : public BlockObserver {
 public:
  struct Load {
    uint64_t pages_used = 0, pages_capacity = 0, open_sequences = 0, queued_decode = 0;
  };
  struct Options {
    ClusterConfig cluster;
    std::string member_id, incarnation;
    std::string tier;              // "device" (cuda backend) or "host" (cpu)
    std::function<Load()> load;    // the figures of the load: hash
    std::function<void()> replay;  // tells BlocksStored of every page held
    // True when `m` (a member that left) is back in membership with the same incarnation:
    // its entries are live again and are not purged. May be null.
    std::function<bool(const MemberInfo& m)> is_member;
  };
  // At most this many block changes wait for the writer; more are dropped (and republished).
  static constexpr size_t kMaxQueued = 1 << 20;
  static constexpr size_t kBatch = 512;  // block changes per pipeline

  explicit BlockIndex(Options options);
  ~BlockIndex() override;
  void Start();
  void Stop();

  void BlocksStored(const BlockNamespace& ns, std::vector<StoredBlock> blocks) override;
  void BlocksRemoved(const BlockNamespace& ns, std::vector<BlockHash> hashes) override;

  // Membership: advertised (write, and republish what was missed) or not (write nothing).
  void SetAdvertised(bool advertised);
  // A member left: purge its entries (queued for the writer).
  void PurgeMember(const MemberInfo& gone);

  // For the metrics and tests.
  uint64_t writes() const { return writes_.load(); }
  uint64_t errors() const { return errors_.load(); }
  uint64_t republishes() const { return republishes_.load(); }
  uint64_t purges() const { return purges_.load(); }
  double lag_seconds() const { return lag_ms_.load() / 1000.0; }

  // Redis keys (docs/cluster.md), public for tests and the cluster client.
  std::string BlockKey(const std::string& hash_hex) const;
  std::string HeldKey(const std::string& member_id, const std::string& incarnation) const;
  std::string LoadKey(const std::string& member_id) const;
  std::string EpochKey() const;
  std::string PurgeKey(const std::string& member_id, const std::string& incarnation) const;

 private:
  struct Change {
    bool stored;
    std::string hash_hex;
    std::chrono::steady_clock::time_point queued;
  };
  struct Purge {
    std::string member_id, incarnation;
  };

  void Enqueue(std::vector<Change> changes);
  void WriterLoop();
  // One pass of the writer; false when Redis failed (the caller backs off).
  bool WriteOnce(bool periodic);
  bool WriteBatch(std::vector<Change> batch);
  bool CheckEpoch();
  bool WriteLoad();
  // Purges one incarnation's entries (only the winner of the purge lock does the work).
  bool PurgeIncarnation(const Purge& p);
  bool PurgeOwnPrevious();
  void Republish();

  const Options o_;
  const std::string prefix_;       // kvcd:{<cluster>}:
  const std::string field_value_;  // <incarnation>:<tier>
  RedisConnection redis_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool advertised_ = false;
  bool dirty_ = false;  // changes were dropped or failed: republish once writing works again
  bool started_clean_ = false;  // own previous incarnations purged
  std::deque<Change> queue_;
  std::vector<Purge> purges_pending_;
  std::string epoch_;  // the epoch seen last ("" before the first check)
  std::thread writer_;

  std::atomic<uint64_t> writes_{0}, errors_{0}, republishes_{0}, purges_{0};
  std::atomic<int64_t> lag_ms_{0};
};

}  // namespace kvcd
