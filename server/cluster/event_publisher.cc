#include "server/cluster/event_publisher.h"

#include <chrono>
#include <msgpack.hpp>
#include <zmq.hpp>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvcd {
namespace {

// At most this many queued events; more wait for the next batch (the publisher thread
// drains them every few ms, so this bounds memory only when it falls far behind).
constexpr size_t kMaxPending = 1 << 20;
// Events per batch.
constexpr size_t kMaxBatchEvents = 1024;

std::string SeqBytes(int64_t seq) {
  std::string b(8, '\0');
  const uint64_t u = static_cast<uint64_t>(seq);
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((u >> (56 - 8 * i)) & 0xff);
  return b;
}

}  // namespace

EventPublisher::EventPublisher(Options options) : o_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<EventPublisher>> EventPublisher::Create(Options options) {
  std::unique_ptr<EventPublisher> p(new EventPublisher(std::move(options)));
  p->ctx_ = std::make_unique<zmq::context_t>(1);
  try {
    p->pub_ = std::make_unique<zmq::socket_t>(*p->ctx_, zmq::socket_type::pub);
    p->pub_->set(zmq::sockopt::linger, 0);
    p->pub_->set(zmq::sockopt::sndhwm, 100000);
    p->pub_->bind(p->o_.endpoint);
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(
        absl::StrCat("cluster.events_endpoint '", p->o_.endpoint, "' cannot be bound: ", e.what()));
  }
  if (!p->o_.replay_endpoint.empty()) {
    try {
      p->replay_ = std::make_unique<zmq::socket_t>(*p->ctx_, zmq::socket_type::router);
      p->replay_->set(zmq::sockopt::linger, 0);
      p->replay_->set(zmq::sockopt::maxmsgsize, int64_t{64});  // a request is 8 bytes
      p->replay_->bind(p->o_.replay_endpoint);
    } catch (const zmq::error_t& e) {
      return absl::UnavailableError(absl::StrCat("cluster.events_replay_endpoint '",
                                                 p->o_.replay_endpoint,
                                                 "' cannot be bound: ", e.what()));
    }
  }
  {
    msgpack::sbuffer ev;
    msgpack::packer<msgpack::sbuffer> pk(ev);
    pk.pack_array(1);
    pk.pack(std::string("AllBlocksCleared"));
    p->pending_.emplace_back(ev.data(), ev.size());
  }
  p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
  return p;
}

EventPublisher::~EventPublisher() { Stop(); }

void EventPublisher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  replay_.reset();
  pub_.reset();
  ctx_.reset();
}

void EventPublisher::Enqueue(std::string event) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_.size() >= kMaxPending) return;  // far behind: dropped (seq stays gapless)
  pending_.push_back(std::move(event));
  cv_.notify_all();
}

void EventPublisher::BlocksStored(const BlockNamespace& ns, std::vector<StoredBlock> blocks) {
  if (blocks.empty()) return;
  msgpack::sbuffer ev;
  msgpack::packer<msgpack::sbuffer> pk(ev);
  pk.pack_array(7);
  pk.pack(std::string("BlockStored"));
  pk.pack_array(static_cast<uint32_t>(blocks.size()));
  for (const StoredBlock& b : blocks) pk.pack(BlockHashEventId(b.hash));
  if (blocks.front().parent == kRootBlockHash) {
    pk.pack_nil();
  } else {
    pk.pack(BlockHashEventId(blocks.front().parent));
  }
  size_t tokens = 0;
  for (const StoredBlock& b : blocks) tokens += b.tokens.size();
  pk.pack_array(static_cast<uint32_t>(tokens));
  for (const StoredBlock& b : blocks) {
    for (const int32_t t : b.tokens) pk.pack(t);
  }
  pk.pack(ns.page_size);
  pk.pack_nil();  // lora_id
  pk.pack(o_.medium);
  Enqueue(std::string(ev.data(), ev.size()));
}

void EventPublisher::BlocksRemoved(const BlockNamespace&, std::vector<BlockHash> hashes) {
  if (hashes.empty()) return;
  msgpack::sbuffer ev;
  msgpack::packer<msgpack::sbuffer> pk(ev);
  pk.pack_array(3);
  pk.pack(std::string("BlockRemoved"));
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  for (const BlockHash& h : hashes) pk.pack(BlockHashEventId(h));
  pk.pack(o_.medium);
  Enqueue(std::string(ev.data(), ev.size()));
}

void EventPublisher::Loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // With a replay socket, wake often enough to answer it; else on events only.
      cv_.wait_for(lock, std::chrono::milliseconds(replay_ ? 5 : 100),
                   [&] { return stopping_ || !pending_.empty(); });
      if (stopping_) return;
    }
    PublishPending();
    if (replay_) AnswerReplay();
  }
}

void EventPublisher::PublishPending() {
  std::vector<std::string> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_.empty()) return;
    if (pending_.size() <= kMaxBatchEvents) {
      events.swap(pending_);
    } else {
      events.assign(std::make_move_iterator(pending_.begin()),
                    std::make_move_iterator(pending_.begin() + kMaxBatchEvents));
      pending_.erase(pending_.begin(), pending_.begin() + kMaxBatchEvents);
      cv_.notify_all();
    }
  }
  msgpack::sbuffer batch;
  msgpack::packer<msgpack::sbuffer> pk(batch);
  pk.pack_array(3);
  pk.pack(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const std::string& e : events) batch.write(e.data(), e.size());
  pk.pack_nil();  // data-parallel rank
  const uint64_t seq = next_seq_++;
  std::string payload(batch.data(), batch.size());
  try {
    pub_->send(zmq::buffer(o_.topic), zmq::send_flags::sndmore);
    pub_->send(zmq::buffer(SeqBytes(static_cast<int64_t>(seq))), zmq::send_flags::sndmore);
    pub_->send(zmq::buffer(payload), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    KVCD_LOG(WARNING) << "cluster: publishing event batch " << seq << " failed: " << e.what();
  }
  published_.fetch_add(1);
  events_.fetch_add(events.size());
  buffer_.emplace_back(seq, std::move(payload));
  while (buffer_.size() > static_cast<size_t>(std::max(1, o_.buffer))) buffer_.pop_front();
}

void EventPublisher::AnswerReplay() {
  for (int served = 0; served < 16; ++served) {
    std::vector<zmq::message_t> frames;
    try {
      zmq::message_t m;
      if (!replay_->recv(m, zmq::recv_flags::dontwait)) return;
      frames.push_back(std::move(m));
      while (frames.back().more()) {
        zmq::message_t next;
        if (!replay_->recv(next, zmq::recv_flags::none)) break;
        frames.push_back(std::move(next));
        if (frames.size() > 4) break;  // not a replay request: drop the rest below
      }
    } catch (const zmq::error_t&) {
      return;
    }
    // [identity, (empty delimiter of a REQ client), 8-byte start]
    if (frames.size() < 2 || frames.size() > 3 || frames.back().size() != 8 ||
        (frames.size() == 3 && frames[1].size() != 0)) {
      continue;  // malformed: ignored (a peer cannot make the publisher do anything else)
    }
    const auto* b = static_cast<const uint8_t*>(frames.back().data());
    uint64_t start = 0;
    for (int i = 0; i < 8; ++i) start = start << 8 | b[i];
    const std::string identity(static_cast<const char*>(frames[0].data()), frames[0].size());
    const bool delimited = frames.size() == 3;
    auto send = [&](const std::string& seq, const std::string& payload) {
      replay_->send(zmq::buffer(identity), zmq::send_flags::sndmore);
      if (delimited) replay_->send(zmq::message_t(), zmq::send_flags::sndmore);
      replay_->send(zmq::buffer(seq), zmq::send_flags::sndmore);
      replay_->send(zmq::buffer(payload), zmq::send_flags::none);
    };
    try {
      for (const auto& [seq, payload] : buffer_) {
        if (seq >= start) send(SeqBytes(static_cast<int64_t>(seq)), payload);
      }
      send(SeqBytes(-1), std::string());
    } catch (const zmq::error_t& e) {
      KVCD_LOG(WARNING) << "cluster: answering an event replay failed: " << e.what();
    }
  }
}

}  // namespace kvcd
