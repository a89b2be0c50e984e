// KV events over ZeroMQ in the schema vLLM and SGLang publish (docs/cluster.md "Events"),
// so that llm-d's KV-cache indexer or Dynamo's KV router can follow this daemon unchanged.
// A PUB socket sends [topic, seq (8 bytes big-endian, from 0, gapless), msgpack
// KVEventBatch = [ts, [events...], nil]]; a ROUTER socket answers an 8-byte big-endian
// start sequence number with every buffered [seq, payload] from there on, then [-1, ""].
// The last `buffer` batches are kept. Events come in as a BlockObserver (queued under a
// model's lock); one thread owns both sockets (ZeroMQ sockets are not thread-safe).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "server/cache/block_observer.h"

namespace zmq {
class context_t;
class socket_t;
}  // namespace zmq

namespace kvcd {

class EventPublisher final : public BlockObserver {
 public:
  struct Options {
    std::string endpoint;         // tcp://host:port of the PUB socket
    std::string replay_endpoint;  // tcp://host:port of the ROUTER socket, or empty
    int buffer = 10000;           // batches kept for replay
    std::string medium = "CPU";   // "GPU" for the cuda backend
    std::string topic;            // the first frame (empty by default)
  };
  // Binds the sockets; UNAVAILABLE naming the endpoint when one cannot be bound. The first
  // batch (sequence 0) is [AllBlocksCleared]: a new incarnation holds nothing.
  static absl::StatusOr<std::unique_ptr<EventPublisher>> Create(Options options);
  ~EventPublisher() override;
  void Stop();

  void BlocksStored(const BlockNamespace& ns, std::vector<StoredBlock> blocks) override;
  void BlocksRemoved(const BlockNamespace& ns, std::vector<BlockHash> hashes) override;

  uint64_t batches_published() const { return published_.load(); }
  uint64_t events_published() const { return events_.load(); }

 private:
  explicit EventPublisher(Options options);
  void Enqueue(std::string event);
  void Loop();
  void PublishPending();
  void AnswerReplay();

  const Options o_;
  std::unique_ptr<zmq::context_t> ctx_;
  std::unique_ptr<zmq::socket_t> pub_, replay_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<std::string> pending_;  // msgpack-encoded events not yet in a batch

  // Publisher thread only.
  uint64_t next_seq_ = 0;
  std::deque<std::pair<uint64_t, std::string>> buffer_;
  std::thread thread_;
  std::atomic<uint64_t> published_{0}, events_{0};
};

}  // namespace kvcd
