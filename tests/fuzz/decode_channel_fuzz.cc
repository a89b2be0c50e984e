// Fuzzes the daemon's reader of a decode channel's shared region (server/dataplane/
// decode_channels): the worker side is hostile. A real channel on a POSIX shared-memory
// object serves the real CacheEngine::AttentionDecode on the CPU backend (a "tiny" model;
// each input gets a freshly opened 24-token sequence); it stays open across inputs until
// one corrupts it, as a worker's channel does. Each input plays the worker:
//
//   byte 0      flags: 1 = rewrite `capacity` after the open, 2 = truncate the object after
//               the open (to 4096 + bytes 1..4 modulo the rest), 4 = set `closed`, 8 = write
//               `request_bytes` from bytes 5..8 instead of the payload's size, 16 = send the
//               payload as raw bytes (else a payload that parses as an AttentionDecodeRequest gets
//               sequence id 0 mapped to the open sequence, so the fuzzer reaches the decode path),
//               32 = hostile values in every other header field (the block below)
//   bytes 1..4  the capacity written with flag 1 (little-endian)
//   bytes 5..8  the request_bytes written with flag 8
//   with flag 32, bytes 9..52 (kHeaderBlock), little-endian:
//     9..16 magic, 17..20 version, 21..24 capacity: the header of a second, fresh object
//               the daemon is asked to open (as large as that capacity needs when it is
//               4096..16384, else 4096): it must open exactly when magic, version and
//               capacity are valid for the object, and refuse with INVALID_ARGUMENT
//               otherwise; then the live channel's magic and version are overwritten too;
//     25..32 request_seq: the number this request is published under (any jump);
//     33..40 response_seq, 41..44 response_bytes, 45..48 doorbell, 49..52 daemon_waiting:
//               written by the worker before it publishes (the daemon's fields, and the
//               doorbell's futex words)
//   then        the request area's content
//
// The daemon must answer within 5 s or end the channel (closed set); an answer must parse
// as an AttentionDecodeStreamResponse of at most `capacity` bytes. When the worker left the
// header intact, a second, valid request on the same channel must then succeed: a bad
// request fails that request only. Flags 1 and 2 reproduce #21 defect 1 (capacity rewritten
// after the open: SIGSEGV; truncation: SIGBUS) until that fix lands. Hostile values in the
// other fields (flag 32; #35) leave the channel intact: it must still answer, asleep on its
// doorbell or not.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "common/decode_channel_layout.h"
#include "server/backends/backend.h"
#include "server/dataplane/decode_channels.h"
#include "server/engine/cache_engine.h"
#include "server/formats/model_spec.h"

namespace kvcd {
namespace {

constexpr uint32_t kCapacity = DecodeChannelHeader::kMinCapacity;
constexpr size_t kHeaderBlock = 44;

struct World {
  std::unique_ptr<CacheEngine> engine;
  uint64_t sequence = 0;
  ModelSpec spec;
};

// One engine for the whole run, and a freshly opened 24-token sequence for each input.
World& TheWorld() {
  static World* w = [] {
    auto* w = new World;
    ServerConfig config;
    config.memory_budget_bytes = 16 << 20;
    config.compute_threads = 1;
    w->engine = std::make_unique<CacheEngine>(config, MakeCpuBackend(1));
    w->spec = *BuiltinModelSpec("tiny");
    w->spec.memory_bytes = 1 << 20;
    if (!w->engine->RegisterModelSpec(w->spec).ok()) __builtin_trap();
    return w;
  }();
  if (w->sequence != 0) {  // a fresh sequence per input: a crash reproduces from its input
    v1::CloseSequenceRequest c;
    c.set_sequence_id(w->sequence);
    v1::CloseSequenceResponse cr;
    (void)w->engine->CloseSequence(c, &cr);
  }
  v1::OpenSequenceRequest open;
  open.set_model(w->spec.name);
  for (int i = 0; i < 24; ++i) open.add_tokens(i);
  v1::OpenSequenceResponse or_;
  if (!w->engine->OpenSequence(open, &or_).ok()) __builtin_trap();
  w->sequence = or_.sequence_id();
  v1::AppendRequest a;
  a.set_sequence_id(w->sequence);
  const int64_t n = 24 - or_.matched_tokens();
  for (int64_t i = or_.matched_tokens(); i < 24; ++i) a.add_tokens(static_cast<int32_t>(i));
  if (n > 0) {
    for (v1::TensorRef* t : {a.mutable_k(), a.mutable_v()}) {
      t->set_dtype(v1::DTYPE_BF16);
      for (int64_t d : {int64_t{w->spec.num_layers}, n, int64_t{w->spec.num_kv_heads},
                        int64_t{w->spec.head_dim}}) {
        t->add_shape(d);
      }
      std::string bytes(
          static_cast<size_t>(w->spec.num_layers * n * w->spec.num_kv_heads * w->spec.head_dim * 2),
          '\0');
      for (size_t i = 0; i < bytes.size(); i += 2) bytes[i + 1] = '\x3f';  // BF16 0.5
      t->set_inline_data(bytes);
    }
    v1::AppendResponse ar;
    if (!w->engine->Append(a, &ar).ok()) __builtin_trap();
  }
  return *w;
}

v1::AttentionDecodeRequest ValidRequest(const World& w) {
  v1::AttentionDecodeRequest r;
  r.set_layer(1);
  r.add_sequence_ids(w.sequence);
  r.mutable_q()->set_dtype(v1::DTYPE_F32);
  for (int64_t d : {int64_t{1}, int64_t{w.spec.num_q_heads}, int64_t{w.spec.head_dim}}) {
    r.mutable_q()->add_shape(d);
  }
  r.mutable_q()->set_inline_data(
      std::string(static_cast<size_t>(w.spec.num_q_heads * w.spec.head_dim * 4), '\0'));
  r.set_request_id(7);
  return r;
}

// Where the answer is in the layout the worker created (capacity kCapacity), whatever the
// header says now.
const uint8_t* ResponseArea(DecodeChannelHeader* h) {
  return reinterpret_cast<const uint8_t*>(h) + DecodeChannelHeader::kAreasOffset + kCapacity;
}

uint32_t Le32(const uint8_t* p) {
  return p[0] | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
uint64_t Le64(const uint8_t* p) { return Le32(p) | (uint64_t{Le32(p + 4)} << 32); }

// A fresh object with a hostile header, opened by the daemon's DecodeChannels: OK exactly
// when the header is valid for the object's size, INVALID_ARGUMENT otherwise; a channel
// that opened is closed again.
void OpenHostile(DecodeChannels& channels, uint64_t magic, uint32_t version, uint32_t capacity) {
  const std::string name = "/kvcd-fuzz-open-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) __builtin_trap();
  const bool sized = capacity >= DecodeChannelHeader::kMinCapacity &&
                     capacity <= 4 * DecodeChannelHeader::kMinCapacity;
  const size_t bytes = DecodeChannelHeader::TotalBytes(sized ? capacity : kCapacity);
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) __builtin_trap();
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) __builtin_trap();
  std::memset(p, 0, bytes);
  auto* h = static_cast<DecodeChannelHeader*>(p);
  h->magic = magic;
  h->version = version;
  h->capacity = capacity;
  const bool valid = magic == DecodeChannelHeader::kMagic &&
                     version == DecodeChannelHeader::kVersion &&
                     capacity >= DecodeChannelHeader::kMinCapacity &&
                     capacity <= DecodeChannelHeader::kMaxCapacity &&
                     DecodeChannelHeader::TotalBytes(capacity) <= bytes;
  absl::StatusOr<uint64_t> opened = channels.Open(name, 60000);
  shm_unlink(name.c_str());
  if (valid != opened.ok() ||
      (!opened.ok() && opened.status().code() != absl::StatusCode::kInvalidArgument)) {
    fprintf(stderr, "open of magic %llx version %u capacity %u (object of %zu bytes): %s\n",
            static_cast<unsigned long long>(magic), version, capacity, bytes,
            opened.status().ToString().c_str());
    __builtin_trap();
  }
  if (opened.ok() && !channels.Close(*opened).ok()) __builtin_trap();
  munmap(p, bytes);
  close(fd);
}

void WriteRequest(DecodeChannelHeader* h, const std::string& payload, bool raw_size,
                  uint32_t size) {
  std::memcpy(h->RequestArea(), payload.data(), std::min<size_t>(payload.size(), kCapacity));
  h->request_bytes.store(raw_size ? size : static_cast<uint32_t>(payload.size()),
                         std::memory_order_relaxed);
}

// Publishes the written request and waits for its answer (false: the channel ended
// instead).
bool Exchange(DecodeChannelHeader* h, uint64_t* seq) {
  *seq += 1;
  h->PublishRequest(*seq);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (h->response_seq.load(std::memory_order_acquire) != *seq) {
    if (h->closed.load(std::memory_order_acquire) != 0) return false;
    if (std::chrono::steady_clock::now() > deadline) {
      fprintf(stderr, "the daemon neither answered nor closed the channel in 5 s\n");
      __builtin_trap();
    }
    std::this_thread::yield();
  }
  return true;
}

// A worker's channel: the shared-memory object it created and the daemon's DecodeChannels
// serving it with the real decode path.
struct Channel {
  explicit Channel(World& w)
      : channels(w.engine.get(), DecodeChannels::Options{/*spin_us=*/50, /*max_channels=*/4}) {
    name = "/kvcd-fuzz-" + std::to_string(getpid());
    fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) __builtin_trap();
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) __builtin_trap();
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) __builtin_trap();
    std::memset(p, 0, bytes);
    header = static_cast<DecodeChannelHeader*>(p);
    header->magic = DecodeChannelHeader::kMagic;
    header->version = DecodeChannelHeader::kVersion;
    header->capacity = kCapacity;
    absl::StatusOr<uint64_t> opened = channels.Open(name, 60000);
    if (!opened.ok()) __builtin_trap();  // a well-formed channel must open
    id = *opened;
    // Both sides have it mapped: the name can go now, so a crash leaves nothing in /dev/shm.
    shm_unlink(name.c_str());
  }
  ~Channel() {
    (void)channels.Close(id);
    channels.CloseAll();
    munmap(header, bytes);
    close(fd);
  }
  DecodeChannels channels;
  std::string name;
  int fd = -1;
  const size_t bytes = DecodeChannelHeader::TotalBytes(kCapacity);
  DecodeChannelHeader* header = nullptr;
  uint64_t id = 0;
  uint64_t seq = 0;
};

}  // namespace
}  // namespace kvcd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcd;
  if (size < 9) return 0;
  const uint8_t flags = data[0];
  const bool hostile = (flags & 32) != 0;
  const size_t payload_at = hostile ? 9 + kHeaderBlock : 9;
  if (size < payload_at) return 0;
  const uint8_t* block = data + 9;
  std::string payload(reinterpret_cast<const char*>(data + payload_at), size - payload_at);
  if (payload.size() > kCapacity) return 0;
  World& w = TheWorld();
  if ((flags & 16) == 0) {
    v1::AttentionDecodeRequest r;
    if (r.ParseFromString(payload)) {
      for (int i = 0; i < r.sequence_ids_size(); ++i) {
        if (r.sequence_ids(i) == 0) r.set_sequence_ids(i, w.sequence);
      }
      payload = r.SerializeAsString();
      if (payload.size() > kCapacity) return 0;
    }
  }

  // The channel stays open from one input to the next while the worker leaves it intact
  // (a live worker sends many requests on one channel); one whose header was rewritten,
  // truncated or closed is replaced.
  static std::unique_ptr<Channel> channel;
  if (channel == nullptr) channel = std::make_unique<Channel>(w);
  DecodeChannelHeader* h = channel->header;
  if (hostile) {
    OpenHostile(channel->channels, Le64(block), Le32(block + 8), Le32(block + 12));
    // The worker scribbles on every field that is not its request's, then publishes under
    // the number it likes (Exchange adds one to channel->seq; an unchanged request_seq
    // would be no request, and a response_seq already equal to it would read as answered).
    h->magic = Le64(block);
    h->version = Le32(block + 8);
    const uint64_t wanted = Le64(block + 16);
    channel->seq = wanted == channel->seq ? wanted : wanted - 1;
    const uint64_t response_seq = Le64(block + 24);
    h->response_seq.store(response_seq == channel->seq + 1 ? channel->seq : response_seq);
    h->response_bytes.store(Le32(block + 32));
    h->doorbell.store(Le32(block + 36));
    h->daemon_waiting.store(Le32(block + 40));
  }
  WriteRequest(h, payload, flags & 8, Le32(data + 5));
  if (flags & 1) h->capacity = Le32(data + 1);
  // The worker keeps the header page (it still writes request_seq there); everything after
  // it may be cut.
  if (flags & 2) {
    (void)ftruncate(channel->fd,
                    static_cast<off_t>(4096 + Le32(data + 1) % (channel->bytes - 4096)));
  }
  if (flags & 4) h->Close();
  const bool answered = Exchange(h, &channel->seq);
  const bool intact = (flags & (1 | 2 | 4)) == 0;
  if (intact && !answered) {
    fprintf(stderr, "the daemon closed an intact channel after a bad request\n");
    __builtin_trap();
  }
  if (answered && (flags & (1 | 2)) == 0) {
    const uint32_t n = h->response_bytes.load(std::memory_order_relaxed);
    v1::AttentionDecodeStreamResponse resp;
    if (n > kCapacity || !resp.ParseFromArray(ResponseArea(h), static_cast<int>(n))) {
      fprintf(stderr, "the answer (%u bytes) is not a stream response\n", n);
      __builtin_trap();
    }
  }
  if (!intact) {
    channel.reset();  // closes the channel, unmaps and unlinks the object
    return 0;
  }
  // The same channel still serves a valid request.
  WriteRequest(h, ValidRequest(w).SerializeAsString(), false, 0);
  if (!Exchange(h, &channel->seq)) __builtin_trap();
  v1::AttentionDecodeStreamResponse resp;
  if (!resp.ParseFromArray(ResponseArea(h), static_cast<int>(h->response_bytes.load())) ||
      resp.request_id() != 7 ||
      resp.error_code() == static_cast<int>(absl::StatusCode::kInternal) ||
      resp.error_code() == static_cast<int>(absl::StatusCode::kUnknown)) {
    fprintf(stderr, "a valid request after a bad one failed: %d %s\n", resp.error_code(),
            resp.error_message().c_str());
    __builtin_trap();
  }
  return 0;
}
