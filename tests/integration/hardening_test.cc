// Integration: the hostile-client defects of issue #21 against the real daemon binary —
// each asserts the exact status code and that the daemon (and what it stores) survives.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "client/client.h"
#include "common/decode_channel_layout.h"
#include "daemon_process.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"
#include "tiny_daemon_fixture.h"

namespace kvcd {
namespace hardening_test {

using testing_util::DaemonProcess;
using testing_util::WaitFor;

constexpr char kConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 16MiB
drain_timeout_ms: 2000
models:
  - builtin: tiny
    memory: 1MiB
)";

class HardeningTest : public testing_util::TinyDaemonTest {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.CaptureStderr());
    StartDaemon(kConfig);
  }

  v1::AttentionDecodeRequest Decode(uint64_t seq, uint64_t request_id) {
    v1::AttentionDecodeRequest r;
    r.set_layer(0);
    r.set_request_id(request_id);
    r.add_sequence_ids(seq);
    const int hq = profile_.num_q_heads(), d = profile_.head_dim();
    SetF32Tensor(r.mutable_q(), {1, hq, d}, synthetic::Row(5, profile_, 0, 8, 2).data());
    return r;
  }
};

// The numbered defects that a client sees over the wire, one table: each call gets its
// exact code, and the stored prefix, the open sequence and the model list are unchanged.
TEST_F(HardeningTest, BadRequestsOverTheWireChangeNothing) {
  ASSERT_TRUE(client_->Put(synthetic::Put(5, profile_, 8)).ok());
  auto seq = client_->OpenSequence("tiny", "", synthetic::Tokens(5, 0, 8), 60000);
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto fingerprint = [&] {
    auto models = client_->ListModels();
    auto match = client_->Match("tiny", "", synthetic::Tokens(5, 0, 8));
    v1::FetchPagesRequest f;
    f.set_sequence_id(seq->sequence_id());
    f.set_expand_to_bf16(true);
    auto fetched = client_->FetchPages(f);
    EXPECT_TRUE(models.ok() && match.ok() && fetched.ok());
    return std::to_string(models->size()) + "|" + std::to_string(match->matched_tokens()) + "|" +
           fetched->k().inline_data() + fetched->v().inline_data();
  };
  const std::string before = fingerprint();
  struct Case {
    const char* name;
    absl::StatusCode code;
    std::function<absl::Status()> call;
  };
  const std::vector<Case> cases = {
      {"#3 NaN in k", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = synthetic::Put(6, profile_, 8);
         (*r.mutable_k()->mutable_inline_data())[11] = static_cast<char>(0x7f);
         (*r.mutable_k()->mutable_inline_data())[10] = static_cast<char>(0xc0);
         return client_->Put(r).status();
       }},
      {"#8 FSQ history format without widths or codec", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::ModelProfile p = profile_;
         p.set_name("fsq");
         p.set_history_format(v1::HISTORY_FORMAT_FSQ);
         return client_->RegisterModel(p).status();
       }},
      {"#9 a 10 KB model name is NOT_FOUND (not a metadata overflow)", absl::StatusCode::kNotFound,
       [&] {
         auto r = synthetic::Put(6, profile_, 8);
         r.set_model(std::string(10240, 'x'));
         return client_->Put(r).status();
       }},
      {"#11 FetchPages num_tokens INT64_MAX", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::FetchPagesRequest f;
         f.set_sequence_id(seq->sequence_id());
         f.set_num_tokens(std::numeric_limits<int64_t>::max());
         return client_->FetchPages(f).status();
       }},
      // Issue #31: the session calls over the wire.
      {"#31 fork with a negative lease", absl::StatusCode::kInvalidArgument,
       [&] { return client_->ForkSequence(seq->sequence_id(), -1).status(); }},
      {"#31 fork with an overflowing lease", absl::StatusCode::kInvalidArgument,
       [&] {
         return client_->ForkSequence(seq->sequence_id(), std::numeric_limits<int64_t>::max())
             .status();
       }},
      {"#31 commit of a sequence that is not open", absl::StatusCode::kNotFound,
       [&] { return client_->CommitSequence(seq->sequence_id() ^ 0x77).status(); }},
      {"#31 close with commit of a sequence that is not open", absl::StatusCode::kNotFound,
       [&] { return client_->CloseSequence(seq->sequence_id() ^ 0x77, true).status(); }},
      // Issue #32: PullPrefix on a daemon without a cluster: section.
      {"#32 PullPrefix without a cluster section", absl::StatusCode::kFailedPrecondition,
       [&] {
         auto stub = v1::KvCache::NewStub(
             grpc::CreateChannel(daemon_.grpc(), grpc::InsecureChannelCredentials()));
         v1::PullPrefixRequest r;
         r.set_model("tiny");
         for (int32_t t : {1, 2, 3, 4, 5, 6, 7, 8}) r.add_tokens(t);
         r.set_peer_member_id("peer");
         v1::PullPrefixResponse resp;
         grpc::ClientContext ctx;
         const grpc::Status g = stub->PullPrefix(&ctx, r, &resp);
         return absl::Status(static_cast<absl::StatusCode>(g.error_code()), g.error_message());
       }},
      {"#2 a flood of one-page models stops at the rounded budget",
       absl::StatusCode::kResourceExhausted,
       [&] {
         absl::Status last;
         for (int i = 0; i < 64 && last.ok(); ++i) {  // 16 MiB budget: at most 7 more pools
           v1::ModelProfile p = profile_;
           p.set_name("flood" + std::to_string(i));
           p.set_memory_bytes(1024);
           last = client_->RegisterModel(p).status();
         }
         return last;
       }},
  };
  for (const auto& c : cases) {
    const absl::Status s = c.call();
    EXPECT_EQ(s.code(), c.code) << c.name << ": " << s;
    EXPECT_LE(s.message().size(), 600u) << c.name;
    if (std::string(c.name).rfind("#2", 0) != 0) {
      EXPECT_EQ(fingerprint(), before) << c.name;
    }
  }
  auto models = client_->ListModels();
  ASSERT_TRUE(models.ok());
  EXPECT_LE(models->size(), 8u);  // tiny (2 MiB) + at most 7 flood models of 2 MiB each
}

// Issue #21.6: SO_REUSEPORT is off, so a second daemon on the same port fails at start-up
// with a clear message and a non-zero exit instead of splitting the connections.
TEST_F(HardeningTest, SecondDaemonOnTheSamePortFailsAtStartUp) {
  DaemonProcess second;
  ASSERT_TRUE(second.CaptureStderr());
  std::string config = kConfig;
  config.replace(config.find("127.0.0.1:0"), 11, daemon_.grpc());
  EXPECT_FALSE(second.Start(config));
  EXPECT_NE(second.WaitExit(), 0);
  const std::string err = second.Stderr();
  EXPECT_NE(err.find("cannot listen on '" + daemon_.grpc() + "'"), std::string::npos) << err;
  EXPECT_NE(err.find("already in use"), std::string::npos) << err;
  auto stats = client_->Stats();  // the first daemon still serves
  EXPECT_TRUE(stats.ok()) << stats.status();
}

// Issue #21.7: a stream message that does not parse ends the stream with
// INVALID_ARGUMENT (not OK), after the valid requests before it were answered.
TEST_F(HardeningTest, GarbageOnTheDecodeStreamEndsItWithInvalidArgument) {
  ASSERT_TRUE(client_->Put(synthetic::Put(5, profile_, 8)).ok());
  auto seq = client_->OpenSequence("tiny", "", synthetic::Tokens(5, 0, 8), 60000);
  ASSERT_TRUE(seq.ok()) << seq.status();

  auto channel = grpc::CreateChannel(daemon_.grpc(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(&ctx, "/kvcd.v1.KvCache/AttentionDecodeStream", &cq);
  auto await = [&](intptr_t tag) {
    void* got = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&got, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(got), tag);
    return ok;
  };
  auto bytes = [](const std::string& s) {
    grpc::Slice slice(s);
    return grpc::ByteBuffer(&slice, 1);
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(await(1));
  call->Write(bytes(Decode(seq->sequence_id(), 41).SerializeAsString()),
              reinterpret_cast<void*>(2));
  ASSERT_TRUE(await(2));
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  ASSERT_TRUE(await(3));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(in.Dump(&slices).ok());
  std::string answer;
  for (const auto& s : slices) answer.append(reinterpret_cast<const char*>(s.begin()), s.size());
  v1::AttentionDecodeStreamResponse resp;
  ASSERT_TRUE(resp.ParseFromString(answer));
  EXPECT_EQ(resp.request_id(), 41u);
  EXPECT_EQ(resp.error_code(), 0) << resp.error_message();

  // Not a protobuf message: a truncated varint field key.
  call->Write(bytes(std::string("\xff\xff\xff\xff\xff", 5)), reinterpret_cast<void*>(4));
  await(4);
  call->Read(&in, reinterpret_cast<void*>(5));
  EXPECT_FALSE(await(5));  // no answer: the stream ended
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(6));
  ASSERT_TRUE(await(6));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("stream message 2 (5 bytes) is not a valid"),
            std::string::npos)
      << status.error_message();
  // The sequence is unchanged and the daemon serves on.
  EXPECT_EQ(*client_->CloseSequence(seq->sequence_id()), 8);
}

// Issue #35.9: a unary request body that does not parse is INVALID_ARGUMENT with a message
// naming the method and the expected message (gRPC's typed handler answered UNIMPLEMENTED
// with an empty message); nothing changes and the daemon serves on.
TEST_F(HardeningTest, UnparseableUnaryBodiesAreInvalidArgument) {
  ASSERT_TRUE(client_->Put(synthetic::Put(5, profile_, 8)).ok());
  auto channel = grpc::CreateChannel(daemon_.grpc(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  const std::string truncated_varint("\xff\xff\xff\xff\xff", 5);
  // PutRequest.model (field 1, a string) holding bytes that are not UTF-8.
  const std::string not_utf8("\x0a\x02\xc3\x28", 4);
  const struct {
    const char* method;
    std::string body;
    const char* type;
  } cases[] = {
      {"Put", truncated_varint, "kvcd.v1.PutRequest"},
      {"Put", not_utf8, "kvcd.v1.PutRequest"},
      {"RegisterModel", truncated_varint, "kvcd.v1.RegisterModelRequest"},
      {"Match", truncated_varint, "kvcd.v1.MatchRequest"},
      {"AttentionDecode", truncated_varint, "kvcd.v1.AttentionDecodeRequest"},
      {"Stats", truncated_varint, "kvcd.v1.StatsRequest"},
      {"CloseDecodeChannel", truncated_varint, "kvcd.v1.CloseDecodeChannelRequest"},
  };
  for (const auto& c : cases) {
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Slice slice(c.body);
    const grpc::ByteBuffer body(&slice, 1);
    auto call = stub.PrepareUnaryCall(&ctx, std::string("/kvcd.v1.KvCache/") + c.method, body, &cq);
    call->StartCall();
    grpc::ByteBuffer answer;
    grpc::Status status;
    call->Finish(&answer, &status, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.method << ": " << status.error_message();
    const std::string want = std::string(c.method) + ": the request body (" +
                             std::to_string(c.body.size()) + " bytes) is not a valid " + c.type;
    EXPECT_NE(status.error_message().find(want), std::string::npos)
        << c.method << ": " << status.error_message();
  }
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->models_size(), 1);
  EXPECT_EQ(stats->models(0).cached_tokens(), 8u);
}

// Issue #21.1: the decode channel's shared region is untrusted. A rewritten capacity and an
// oversized request_bytes get an error answer on that channel; truncating the object under
// the daemon's mapping (SIGBUS) closes that channel alone; the daemon serves on.
TEST_F(HardeningTest, ACorruptOrTruncatedDecodeChannelCannotCrashTheDaemon) {
  ASSERT_TRUE(client_->Put(synthetic::Put(5, profile_, 8)).ok());
  auto seq = client_->OpenSequence("tiny", "", synthetic::Tokens(5, 0, 8), 60000);
  ASSERT_TRUE(seq.ok()) << seq.status();
  const uint32_t capacity = 1 << 16;
  const size_t bytes = DecodeChannelHeader::TotalBytes(capacity);
  const std::string name = "/kvcd-hardening-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  auto* h = new (p) DecodeChannelHeader{};
  h->magic = DecodeChannelHeader::kMagic;
  h->version = DecodeChannelHeader::kVersion;
  h->capacity = capacity;
  v1::OpenDecodeChannelRequest open;
  open.set_shm_name(name);
  open.set_lease_ms(60000);
  v1::OpenDecodeChannelResponse opened;
  ASSERT_TRUE(client_->OpenDecodeChannelRpc(open, &opened).ok());
  shm_unlink(name.c_str());

  uint64_t next_seq = h->request_seq.load();
  // Sends raw request bytes (or only a request_bytes value) and waits for the answer.
  auto send = [&](const std::string& msg, uint32_t claimed_bytes) {
    std::memcpy(h->RequestArea(), msg.data(), std::min<size_t>(msg.size(), capacity));
    h->request_bytes.store(claimed_bytes, std::memory_order_relaxed);
    h->PublishRequest(++next_seq);
    EXPECT_TRUE(
        WaitFor([&] { return h->response_seq.load() == next_seq; }, std::chrono::seconds(10)));
    v1::AttentionDecodeStreamResponse r;
    const uint32_t n = h->response_bytes.load();
    EXPECT_LE(n, capacity);
    EXPECT_TRUE(r.ParseFromArray(h->RequestArea() + capacity, static_cast<int>(n)));
    return r;
  };
  const std::string good = Decode(seq->sequence_id(), 7).SerializeAsString();
  auto r = send(good, static_cast<uint32_t>(good.size()));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(r.request_id(), 7u);

  // The client rewrites capacity (the daemon used to index with it) and claims 1 GiB.
  h->capacity = 0xffffffffu;
  r = send(good, 1u << 30);
  EXPECT_EQ(r.error_code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.error_message().find("more than the channel's capacity 65536"), std::string::npos)
      << r.error_message();
  // Garbage within the area: an error answer, the channel stays up.
  r = send(std::string(64, '\xff'), 64);
  EXPECT_EQ(r.error_code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  r = send(good, static_cast<uint32_t>(good.size()));  // still served (capacity ignored)
  EXPECT_EQ(r.error_code(), 0) << r.error_message();

  // Truncate the object under the daemon's mapping: its next look faults (SIGBUS).
  ASSERT_EQ(ftruncate(fd, 0), 0);
  EXPECT_TRUE(WaitFor([&] { return daemon_.Stderr().find("SIGBUS caught") != std::string::npos; },
                      std::chrono::seconds(10)))
      << daemon_.Stderr();
  EXPECT_EQ(client_->CloseDecodeChannel(opened.channel_id()).code(), absl::StatusCode::kNotFound);
  munmap(p, bytes);
  close(fd);

  // The daemon is alive, the stored prefix and the sequence are intact.
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(client_->Match("tiny", "", synthetic::Tokens(5, 0, 8))->matched_tokens(), 8);
  EXPECT_EQ(*client_->CloseSequence(seq->sequence_id()), 8);
}

// Issue #21.5: ids are random 64-bit values, so a stale client's id from before a restart
// names nothing in the new process (and never another client's sequence).
TEST_F(HardeningTest, SequenceIdsAreUnguessableAndNotReusedAcrossRestarts) {
  std::set<uint64_t> before;
  for (int i = 0; i < 16; ++i) {
    auto s = client_->OpenSequence("tiny", "", {1, 2, 3}, 60000);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_GT(s->sequence_id(), uint64_t{1} << 20);  // not a small counter (p ~ 2^-44)
    before.insert(s->sequence_id());
  }
  EXPECT_EQ(before.size(), 16u);
  // Neighbours of a live id are not live ids.
  EXPECT_EQ(client_->RenewLease(*before.begin() + 1).status().code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(daemon_.Stop(), 0);
  ASSERT_TRUE(daemon_.Start(kConfig));
  Connect();
  auto fresh = client_->OpenSequence("tiny", "", {1, 2, 3}, 60000);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(before.count(fresh->sequence_id()), 0u);
  for (uint64_t stale : before) {
    EXPECT_EQ(client_->CloseSequence(stale).status().code(), absl::StatusCode::kNotFound);
  }
  // The new client's sequence survived the stale client's closes.
  EXPECT_TRUE(client_->RenewLease(fresh->sequence_id()).ok());
}

// A drain with an idle client holding a decode stream and a health Watch: the watch sees
// NOT_SERVING, then both end with UNAVAILABLE (not CANCELLED), and the drain does not
// wait for them until drain_timeout_ms (2000 ms here).
TEST_F(HardeningTest, DrainEndsIdleStreamsAndWatchesWithUnavailable) {
  ASSERT_TRUE(client_->Put(synthetic::Put(5, profile_, 8)).ok());
  auto seq = client_->OpenSequence("tiny", "", synthetic::Tokens(5, 0, 8), 60000);
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto stream = client_->OpenDecodeStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Call(Decode(seq->sequence_id(), 1)).ok());  // established, now idle

  auto channel = grpc::CreateChannel(daemon_.grpc(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::health::v1::HealthCheckRequest hreq;
  auto watch = health->Watch(&watch_ctx, hreq);
  grpc::health::v1::HealthCheckResponse hresp;
  ASSERT_TRUE(watch->Read(&hresp));
  EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  int rc = -1;
  std::thread stopper([&] { rc = daemon_.Stop(); });  // SIGTERM: drain
  ASSERT_TRUE(watch->Read(&hresp));
  EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(watch->Read(&hresp));
  const grpc::Status ws = watch->Finish();
  EXPECT_EQ(ws.error_code(), grpc::StatusCode::UNAVAILABLE) << ws.error_message();
  auto after = (*stream)->Call(Decode(seq->sequence_id(), 2));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  stopper.join();
  EXPECT_EQ(rc, 0);
  const std::string log = daemon_.Stderr();
  const auto at = log.find("drain: api ");
  ASSERT_NE(at, std::string::npos) << log;
  EXPECT_LT(std::stoi(log.substr(at + 11)), 1000) << log.substr(at, 80);
}

}  // namespace hardening_test
}  // namespace kvcd
