// The daemon's KV events over ZeroMQ (docs/cluster.md "Events"), read by an independent
// subscriber (cppzmq, msgpack-cxx): the frames, vLLM's KVEventBatch schema, block ids that
// are the block hashes' event ids, gapless sequence numbers, and the replay endpoint
// answering the same batches.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <msgpack.hpp>
#include <string>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "client/client.h"
#include "cluster_servers.h"
#include "common/block_hash.h"
#include "daemon_process.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace cluster_events_test {

using testing_util::DaemonProcess;
using testing_util::FreeLoopbackPort;

int64_t Seq(const zmq::message_t& m) {
  EXPECT_EQ(m.size(), 8u);
  const auto* b = static_cast<const uint8_t*>(m.data());
  uint64_t v = 0;
  for (size_t i = 0; i < 8 && i < m.size(); ++i) v = v << 8 | b[i];
  return static_cast<int64_t>(v);
}

struct Batch {
  double ts = 0;
  std::vector<msgpack::object> events;
  msgpack::object_handle handle;  // owns events
};

// Checks the KVEventBatch shape: [float ts, [events...], nil].
Batch Decode(const std::string& payload) {
  Batch b;
  b.handle = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& o = b.handle.get();
  EXPECT_EQ(o.type, msgpack::type::ARRAY);
  EXPECT_EQ(o.via.array.size, 3u);
  if (o.type != msgpack::type::ARRAY || o.via.array.size != 3) return b;
  EXPECT_EQ(o.via.array.ptr[0].type, msgpack::type::FLOAT64);
  b.ts = o.via.array.ptr[0].as<double>();
  EXPECT_EQ(o.via.array.ptr[1].type, msgpack::type::ARRAY);
  EXPECT_EQ(o.via.array.ptr[2].type, msgpack::type::NIL);
  for (uint32_t i = 0; i < o.via.array.ptr[1].via.array.size; ++i) {
    b.events.push_back(o.via.array.ptr[1].via.array.ptr[i]);
  }
  return b;
}

std::string Tag(const msgpack::object& e) {
  if (e.type != msgpack::type::ARRAY || e.via.array.size == 0) return "";
  return e.via.array.ptr[0].as<std::string>();
}

TEST(ClusterEventsTest, VllmSchemaGaplessAndReplay) {
  const int pub_port = FreeLoopbackPort(), replay_port = FreeLoopbackPort();
  const std::string pub = "tcp://127.0.0.1:" + std::to_string(pub_port);
  const std::string replay = "tcp://127.0.0.1:" + std::to_string(replay_port);
  DaemonProcess d;
  ASSERT_TRUE(d.Start(R"(
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 16384
cluster:
  events_endpoint: )" +
                      pub + R"(
  events_replay_endpoint: )" +
                      replay + R"(
  events_buffer: 1000
)"));
  zmq::context_t ctx(1);
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "");
  sub.set(zmq::sockopt::rcvtimeo, 200);
  sub.connect(pub);

  ClientOptions o;
  o.target = d.grpc();
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok());
  auto model = (*c)->GetModel("tiny");
  ASSERT_TRUE(model.ok());

  // Until the subscription is live, batches go unseen (ZeroMQ's PUB drops them): store new
  // prompts until one arrives (bounded), then a known one.
  std::map<int64_t, std::string> seen;  // seq -> payload
  auto receive = [&]() -> bool {
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(sub, std::back_inserter(frames))) return false;
    EXPECT_EQ(frames.size(), 3u);
    if (frames.size() != 3) return false;
    EXPECT_EQ(frames[0].size(), 0u) << "the topic is empty by default";
    seen[Seq(frames[1])] = frames[2].to_string();
    return true;
  };
  bool live = false;
  for (uint64_t seed = 500; seed < 550 && !live; ++seed) {
    ASSERT_TRUE((*c)->Put(synthetic::Put(seed, model->profile(), 4)).ok());
    live = receive();
  }
  ASSERT_TRUE(live) << "no event batch reached the subscriber";
  const int64_t first_seen = seen.begin()->first;
  // The known prompt: 3 pages; then evict it with a flood of 2-page prompts (pool of 16).
  ASSERT_TRUE((*c)->Put(synthetic::Put(1, model->profile(), 12)).ok());
  for (uint64_t seed = 100; seed < 120; ++seed) {
    ASSERT_TRUE((*c)->Put(synthetic::Put(seed, model->profile(), 8)).ok());
  }
  std::vector<int64_t> want;
  for (const BlockHash& h :
       BlockHashes(BlockNamespace{"tiny", "", "bf16", 4}, synthetic::Tokens(1, 0, 12))) {
    want.push_back(BlockHashEventId(h));
  }
  bool stored = false, removed = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!(stored && removed) && std::chrono::steady_clock::now() < deadline) {
    if (!receive()) continue;
    const Batch b = Decode(seen.rbegin()->second);
    for (const msgpack::object& e : b.events) {
      const std::string tag = Tag(e);
      if (tag == "BlockStored") {
        ASSERT_EQ(e.via.array.size, 7u);
        const auto ids = e.via.array.ptr[1].as<std::vector<int64_t>>();
        if (ids != want) continue;
        stored = true;
        EXPECT_EQ(e.via.array.ptr[2].type, msgpack::type::NIL) << "page 0 has no parent";
        EXPECT_EQ(e.via.array.ptr[3].as<std::vector<int32_t>>(), synthetic::Tokens(1, 0, 12));
        EXPECT_EQ(e.via.array.ptr[4].as<int>(), 4);
        EXPECT_EQ(e.via.array.ptr[5].type, msgpack::type::NIL);
        EXPECT_EQ(e.via.array.ptr[6].as<std::string>(), "CPU");
      } else if (tag == "BlockRemoved") {
        ASSERT_EQ(e.via.array.size, 3u);
        for (const int64_t id : e.via.array.ptr[1].as<std::vector<int64_t>>()) {
          removed = removed || id == want.back();
        }
        EXPECT_EQ(e.via.array.ptr[2].as<std::string>(), "CPU");
      } else {
        ADD_FAILURE() << "unexpected event tag '" << tag << "'";
      }
    }
  }
  EXPECT_TRUE(stored) << "no BlockStored with the prompt's block ids";
  EXPECT_TRUE(removed) << "no BlockRemoved for the evicted page";
  // Gapless from the first batch the subscriber saw.
  int64_t expect = first_seen;
  for (const auto& [seq, payload] : seen) EXPECT_EQ(seq, expect++);

  // Replay from 0: every batch, the same payloads as published, then the end marker.
  zmq::socket_t req(ctx, zmq::socket_type::dealer);
  req.set(zmq::sockopt::rcvtimeo, 5000);
  req.connect(replay);
  std::string start(8, '\0');
  req.send(zmq::message_t(), zmq::send_flags::sndmore);
  req.send(zmq::buffer(start), zmq::send_flags::none);
  int64_t next = 0;
  bool ended = false;
  while (!ended) {
    std::vector<zmq::message_t> frames;
    ASSERT_TRUE(zmq::recv_multipart(req, std::back_inserter(frames))) << "replay timed out";
    ASSERT_EQ(frames.size(), 3u);  // delimiter, seq, payload
    const int64_t seq = Seq(frames[1]);
    if (seq == -1) {
      ended = true;
      break;
    }
    EXPECT_EQ(seq, next++);
    const std::string payload = frames[2].to_string();
    Decode(payload);
    if (seq == 0) {
      const Batch b = Decode(payload);
      ASSERT_EQ(b.events.size(), 1u);
      EXPECT_EQ(Tag(b.events[0]), "AllBlocksCleared");
    }
    const auto it = seen.find(seq);
    if (it != seen.end()) {
      EXPECT_EQ(it->second, payload) << "replayed batch " << seq;
    }
  }
  EXPECT_GT(next, seen.rbegin()->first) << "the replay missed published batches";
}

}  // namespace cluster_events_test
}  // namespace kvcd
