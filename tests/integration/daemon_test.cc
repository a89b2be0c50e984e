// Integration: the real kvcd binary on a loopback port, driven by the real client.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "client/client.h"
#include "client/decode_channel.h"
#include "common/decode_channel_layout.h"
#include "common/rotation.h"
#include "common/safetensors.h"
#include "daemon_process.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/reference_attention.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"
#include "tiny_daemon_fixture.h"

namespace kvcd {
namespace daemon_test {

using testing_util::DaemonProcess;
using testing_util::ReadFile;
using testing_util::WaitFor;

// The shared tiny config, and "cramped": a tiny model of 4 pages of 1 KiB.
std::string Config() {
  return std::string(testing_util::kTinyDaemonConfig) + R"(  - builtin: tiny
    name: cramped
    memory: 4096
)";
}

using kernels::RoundBf16;

// The lines of /proc/self/maps that map a decode channel's shared memory (/dev/shm/kvcd-*).
std::set<std::string> ChannelMappings() {
  std::set<std::string> out;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find("/dev/shm/kvcd-") != std::string::npos) out.insert(line);
  return out;
}

// CPU ticks (utime + stime) of a process's threads named `comm`, and how many there are.
std::pair<int64_t, int> ThreadTicks(pid_t pid, const std::string& comm) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  int64_t ticks = 0;
  int threads = 0;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return {-1, 0};
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string stat = ReadFile(dir + "/" + e->d_name + "/stat");
    const size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    if (stat.substr(open + 1, close - open - 1) != comm) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string field;
    int64_t utime = 0, stime = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {  // fields 14, 15: utime, stime
      if (i == 14) utime = std::stoll(field);
      if (i == 15) stime = std::stoll(field);
    }
    ticks += utime + stime;
    ++threads;
  }
  closedir(d);
  return {ticks, threads};
}

class DaemonTest : public testing_util::TinyDaemonTest {
 protected:
  void SetUp() override { StartDaemon(Config()); }

  // synthetic::Put of profile_'s shape for `model`, which may be another model of that shape
  // (cramped, tiny-int2).
  v1::PutRequest MakePut(const std::string& model, uint64_t seed, int64_t n,
                         const std::string& salt = "") {
    v1::PutRequest req = synthetic::Put(seed, profile_, n, salt);
    req.set_model(model);
    return req;
  }
};

TEST_F(DaemonTest, PutMatchOpenAppendAttendClose) {
  auto put = client_->Put(MakePut("tiny", 11, 22));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->inserted_tokens(), 20);
  const auto tokens = synthetic::Tokens(11, 0, 26);
  auto m = client_->Match("tiny", "", tokens);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->matched_tokens(), 20);
  auto open = client_->OpenSequence("tiny", "", tokens, 60000);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(open->matched_tokens(), 20);
  v1::AppendRequest app;
  app.set_sequence_id(open->sequence_id());
  app.mutable_tokens()->Add(tokens.begin() + 20, tokens.end());
  const std::vector<int64_t> shape = {profile_.num_layers(), 6, profile_.num_kv_heads(),
                                      profile_.head_dim()};
  SetBf16FromFloat(app.mutable_k(), shape, synthetic::Kv(11, profile_, 20, 6, 0).data());
  SetBf16FromFloat(app.mutable_v(), shape, synthetic::Kv(11, profile_, 20, 6, 1).data());
  auto len = client_->Append(app);
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, 26);

  // Unary attention at layer 1 against the float64 reference.
  const int hq = profile_.num_q_heads(), hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  v1::AttentionDecodeRequest req;
  req.set_layer(1);
  req.add_sequence_ids(open->sequence_id());
  const auto q = synthetic::Row(11, profile_, 1, 26, 2);
  SetF32Tensor(req.mutable_q(), {1, hq, d}, q.data());
  auto resp = client_->AttentionDecode(req);
  ASSERT_TRUE(resp.ok()) << resp.status();
  std::vector<float> k(26 * hkv * d), v(26 * hkv * d);
  for (int64_t t = 0; t < 26; ++t)
    for (int h = 0; h < hkv; ++h)
      for (int c = 0; c < d; ++c) {
        k[(t * hkv + h) * d + c] = RoundBf16(synthetic::Value(11, 1, t, h, c, 0));
        v[(t * hkv + h) * d + c] = RoundBf16(synthetic::Value(11, 1, t, h, c, 1));
      }
  std::vector<double> ro(hq * d), rl(hq);
  kernels::ReferenceAttention(q.data(), k.data(), v.data(), 26, hq, hkv, d, 1.0 / std::sqrt(16.0),
                              ro.data(), rl.data());
  for (int i = 0; i < hq * d; ++i) EXPECT_NEAR(ElementAsFloat(resp->o(), i), ro[i], 1e-5);
  for (int h = 0; h < hq; ++h) EXPECT_NEAR(ElementAsFloat(resp->lse(), h), rl[h], 1e-5);

  // The streamed per-layer loop: two tokens through both layers.
  auto stream = client_->OpenDecodeStream();
  ASSERT_TRUE(stream.ok());
  for (int64_t pos = 26; pos < 28; ++pos) {
    for (int32_t l = 0; l < profile_.num_layers(); ++l) {
      v1::AttentionDecodeRequest r;
      r.set_layer(l);
      r.add_sequence_ids(open->sequence_id());
      r.set_request_id(pos * 10 + l);
      SetF32Tensor(r.mutable_q(), {1, hq, d}, synthetic::Row(11, profile_, l, pos, 2).data());
      SetBf16FromFloat(r.mutable_k_new(), {1, hkv, d},
                       synthetic::Row(11, profile_, l, pos, 0).data());
      SetBf16FromFloat(r.mutable_v_new(), {1, hkv, d},
                       synthetic::Row(11, profile_, l, pos, 1).data());
      r.add_new_tokens(synthetic::Token(11, pos));
      auto a = (*stream)->Call(r);
      ASSERT_TRUE(a.ok()) << a.status();
      EXPECT_EQ(a->request_id(), static_cast<uint64_t>(pos * 10 + l));
      EXPECT_EQ(a->lengths(0), pos + 1);
    }
  }
  // A bad request in the stream is answered with its code; the stream stays usable.
  v1::AttentionDecodeRequest bad;
  bad.set_layer(7);
  bad.add_sequence_ids(open->sequence_id());
  auto e = (*stream)->Call(bad);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("layer is 7"), std::string::npos) << e.status();
  req.set_layer(0);
  EXPECT_TRUE((*stream)->Call(req).ok());
  EXPECT_TRUE((*stream)->Close().ok());

  auto closed = client_->CloseSequence(open->sequence_id());
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(*closed, 28);
  EXPECT_EQ(client_->CloseSequence(open->sequence_id()).status().code(),
            absl::StatusCode::kNotFound);
}

// The shared-memory decode channel answers exactly what the gRPC stream answers, appends
// through it, reports per-request errors, and refuses bad channels.
TEST_F(DaemonTest, DecodeChannelMatchesTheStream) {
  ASSERT_TRUE(client_->Put(MakePut("tiny", 13, 24)).ok());
  const auto tokens = synthetic::Tokens(13, 0, 24);
  auto s1 = client_->OpenSequence("tiny", "", tokens, 60000);
  auto s2 = client_->OpenSequence("tiny", "", tokens, 60000);
  ASSERT_TRUE(s1.ok() && s2.ok());
  const int hq = profile_.num_q_heads(), hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  auto stream = client_->OpenDecodeStream();
  ASSERT_TRUE(stream.ok());
  auto channel = DecodeChannel::Open(client_.get(), 1 << 16, 60000);
  ASSERT_TRUE(channel.ok()) << channel.status();
  for (int64_t pos = 24; pos < 27; ++pos) {
    for (int32_t l = 0; l < profile_.num_layers(); ++l) {
      v1::AttentionDecodeRequest r;
      r.set_layer(l);
      r.set_request_id(pos * 10 + l);
      SetF32Tensor(r.mutable_q(), {1, hq, d}, synthetic::Row(13, profile_, l, pos, 2).data());
      SetBf16FromFloat(r.mutable_k_new(), {1, hkv, d},
                       synthetic::Row(13, profile_, l, pos, 0).data());
      SetBf16FromFloat(r.mutable_v_new(), {1, hkv, d},
                       synthetic::Row(13, profile_, l, pos, 1).data());
      r.add_new_tokens(synthetic::Token(13, pos));
      v1::AttentionDecodeRequest r2 = r;
      r.add_sequence_ids(s1->sequence_id());
      r2.add_sequence_ids(s2->sequence_id());
      auto a = (*stream)->Call(r);
      auto b = (*channel)->Call(r2);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      EXPECT_EQ(b->request_id(), static_cast<uint64_t>(pos * 10 + l));
      EXPECT_EQ(b->lengths(0), pos + 1);
      ASSERT_EQ(a->o().inline_data(), b->o().inline_data());
      ASSERT_EQ(a->lse().inline_data(), b->lse().inline_data());
    }
  }
  v1::AttentionDecodeRequest bad;
  bad.set_layer(0);
  bad.add_sequence_ids(987654);
  auto e = (*channel)->Call(bad);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound) << e.status();
  EXPECT_TRUE((*channel)->Close().ok());
  EXPECT_EQ((*channel)->Call(bad).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*client_->CloseSequence(s2->sequence_id()), 27);

  // Bad channels: a name outside /kvcd-*, a missing object, an object that is not a channel.
  v1::OpenDecodeChannelRequest req;
  v1::OpenDecodeChannelResponse resp;
  req.set_shm_name("/etc-passwd");
  EXPECT_EQ(client_->OpenDecodeChannelRpc(req, &resp).code(), absl::StatusCode::kInvalidArgument);
  req.set_shm_name("/kvcd-../x");
  EXPECT_EQ(client_->OpenDecodeChannelRpc(req, &resp).code(), absl::StatusCode::kInvalidArgument);
  req.set_shm_name("/kvcd-absent-" + std::to_string(getpid()));
  EXPECT_EQ(client_->OpenDecodeChannelRpc(req, &resp).code(), absl::StatusCode::kNotFound);
  const std::string junk = "/kvcd-junk-" + std::to_string(getpid());
  const int fd = shm_open(junk.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 1 << 16), 0);
  close(fd);
  req.set_shm_name(junk);
  EXPECT_EQ(client_->OpenDecodeChannelRpc(req, &resp).code(), absl::StatusCode::kInvalidArgument);
  shm_unlink(junk.c_str());
  EXPECT_EQ(client_->CloseDecodeChannel(424242).code(), absl::StatusCode::kNotFound);

  // An idle channel is closed by the daemon after its lease: wait for the daemon to set the
  // channel's `closed` word (seen through this process's mapping of it, found as the one
  // decode-channel mapping that appeared with the Open), then a call is refused.
  const std::set<std::string> before = ChannelMappings();
  auto idle = DecodeChannel::Open(client_.get(), 1 << 16, 30);
  ASSERT_TRUE(idle.ok()) << idle.status();
  const DecodeChannelHeader* header = nullptr;
  for (const std::string& m : ChannelMappings())
    if (!before.count(m))
      header = reinterpret_cast<const DecodeChannelHeader*>(
          std::stoull(m.substr(0, m.find('-')), nullptr, 16));
  ASSERT_NE(header, nullptr) << "no new decode-channel mapping in /proc/self/maps";
  ASSERT_EQ(header->magic, DecodeChannelHeader::kMagic);
  EXPECT_TRUE(WaitFor([&] { return header->closed.load(std::memory_order_acquire) != 0; },
                      std::chrono::seconds(10)));
  v1::AttentionDecodeRequest ok_req;
  ok_req.set_layer(0);
  ok_req.add_sequence_ids(s1->sequence_id());
  SetF32Tensor(ok_req.mutable_q(), {1, hq, d}, synthetic::Row(13, profile_, 0, 30, 2).data());
  EXPECT_EQ((*idle)->Call(ok_req).status().code(), absl::StatusCode::kUnavailable);
}

// Issue #36: a channel's device signal words (decode_channel_layout.h) order only the CUDA IPC
// buffer they name. On the CPU backend, with words set (naming a buffer that was never
// registered), inline calls answer exactly as over the stream, and a cuda_ipc tensor is
// refused as before, storing nothing.
TEST_F(DaemonTest, DecodeChannelSignalWordsLeaveInlineCallsAlone) {
  ASSERT_TRUE(client_->Put(MakePut("tiny", 17, 24)).ok());
  const auto tokens = synthetic::Tokens(17, 0, 24);
  auto s1 = client_->OpenSequence("tiny", "", tokens, 60000);
  auto s2 = client_->OpenSequence("tiny", "", tokens, 60000);
  ASSERT_TRUE(s1.ok() && s2.ok());
  const int hq = profile_.num_q_heads(), hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  auto stream = client_->OpenDecodeStream();
  ASSERT_TRUE(stream.ok());
  auto channel = DecodeChannel::Open(client_.get(), 1 << 16, 60000);
  ASSERT_TRUE(channel.ok()) << channel.status();
  (*channel)->SetDeviceSignal(/*buffer_id=*/0x5eed, /*offset=*/64);
  EXPECT_EQ((*channel)->NextSignalValue(), 1u);
  for (int32_t l = 0; l < profile_.num_layers(); ++l) {
    v1::AttentionDecodeRequest r;
    r.set_layer(l);
    SetF32Tensor(r.mutable_q(), {1, hq, d}, synthetic::Row(17, profile_, l, 24, 2).data());
    SetBf16FromFloat(r.mutable_k_new(), {1, hkv, d}, synthetic::Row(17, profile_, l, 24, 0).data());
    SetBf16FromFloat(r.mutable_v_new(), {1, hkv, d}, synthetic::Row(17, profile_, l, 24, 1).data());
    r.add_new_tokens(synthetic::Token(17, 24));
    v1::AttentionDecodeRequest r2 = r;
    r.add_sequence_ids(s1->sequence_id());
    r2.add_sequence_ids(s2->sequence_id());
    auto a = (*stream)->Call(r);
    auto b = (*channel)->Call(r2);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->o().inline_data(), b->o().inline_data());
    ASSERT_EQ(a->lse().inline_data(), b->lse().inline_data());
  }
  EXPECT_EQ((*channel)->NextSignalValue(), static_cast<uint32_t>(profile_.num_layers()) + 1);
  // A device tensor on the CPU backend: refused, as without the words; the length stays.
  v1::AttentionDecodeRequest dev;
  dev.set_layer(0);
  dev.add_sequence_ids(s2->sequence_id());
  SetIpcTensor(dev.mutable_q(), v1::DTYPE_F32, {1, hq, d}, 0x5eed, 0);
  auto refused = (*channel)->Call(dev);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE((*channel)->Close().ok());
  EXPECT_EQ(*client_->CloseSequence(s2->sequence_id()), 25);
  EXPECT_EQ(*client_->CloseSequence(s1->sequence_id()), 25);
}

// Issue #35.4: each idle channel burnt ~0.19 of a core in a 20 us sleep-poll, so 64 of them
// took the host and another tenant's Match took seconds. Past the spin window a channel's
// thread sleeps on the region's doorbell (daemon_waiting set): while 64 channels idle, their
// threads use (almost) no CPU, another client's Match stays fast, a request wakes its
// channel at once, and closing all 64 sleeping channels is prompt.
TEST_F(DaemonTest, IdleDecodeChannelsSleepAndCostNothing) {
  ASSERT_TRUE(client_->Put(MakePut("tiny", 35, 16, "other")).ok());
  const auto tokens = synthetic::Tokens(35, 0, 16);
  auto match_p50 = [&] {
    std::vector<double> ms;
    for (int i = 0; i < 41; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      auto m = client_->Match("tiny", "other", tokens);
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      EXPECT_TRUE(m.ok() && m->matched_tokens() == 16);
    }
    std::nth_element(ms.begin(), ms.begin() + 20, ms.end());
    return ms[20];
  };
  const double baseline_ms = match_p50();

  const std::set<std::string> before = ChannelMappings();
  std::vector<std::unique_ptr<DecodeChannel>> channels;
  for (int i = 0; i < 64; ++i) {
    auto ch = DecodeChannel::Open(client_.get(), DecodeChannelHeader::kMinCapacity, 60000);
    ASSERT_TRUE(ch.ok()) << i << ": " << ch.status();
    channels.push_back(std::move(*ch));
  }
  std::vector<const DecodeChannelHeader*> headers;
  for (const std::string& m : ChannelMappings())
    if (!before.count(m))
      headers.push_back(reinterpret_cast<const DecodeChannelHeader*>(
          std::stoull(m.substr(0, m.find('-')), nullptr, 16)));
  ASSERT_EQ(headers.size(), 64u);
  // The event: every channel's thread went to sleep on its doorbell.
  ASSERT_TRUE(WaitFor(
      [&] {
        return std::all_of(headers.begin(), headers.end(),
                           [](const DecodeChannelHeader* h) { return h->daemon_waiting.load(); });
      },
      std::chrono::seconds(20)));

  // Another client's Matches for at least half a second with the 64 channels idle.
  const auto [ticks_before, threads] = ThreadTicks(daemon_.pid(), "kvcd-channel");
  ASSERT_EQ(threads, 64);
  const auto t0 = std::chrono::steady_clock::now();
  double with_channels_ms = 0;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(500)) {
    with_channels_ms = std::max(with_channels_ms, match_p50());
  }
  const double window_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t ticks = ThreadTicks(daemon_.pid(), "kvcd-channel").first - ticks_before;
  const int64_t hz = sysconf(_SC_CLK_TCK);
  // The sleep-poll took about 0.19 core each: 64 threads, every core of the host. Sleeping on
  // the doorbell they wake 5 times a second each: a few ticks at most in all.
  EXPECT_LE(ticks, 5 + static_cast<int64_t>(0.01 * window_s * hz))
      << ticks << " ticks of the 64 channel threads in " << window_s << " s";
  EXPECT_LE(with_channels_ms, 10 * baseline_ms + 5)
      << "Match p50 " << with_channels_ms << " ms with 64 idle channels, " << baseline_ms
      << " ms before";

  // A request wakes a sleeping channel and is answered.
  auto seq = client_->OpenSequence("tiny", "other", tokens, 60000);
  ASSERT_TRUE(seq.ok()) << seq.status();
  v1::AttentionDecodeRequest req;
  req.set_layer(0);
  req.add_sequence_ids(seq->sequence_id());
  SetF32Tensor(req.mutable_q(), {1, profile_.num_q_heads(), profile_.head_dim()},
               synthetic::Row(35, profile_, 0, 16, 2).data());
  for (auto& ch : {channels.front().get(), channels.back().get()}) {
    auto r = ch->Call(req);
    EXPECT_TRUE(r.ok()) << r.status();
  }
  // All 64 close (each woken from its doorbell) and free their slots.
  channels.clear();
  EXPECT_EQ(ThreadTicks(daemon_.pid(), "kvcd-channel").second, 0);
  auto again = DecodeChannel::Open(client_.get(), DecodeChannelHeader::kMinCapacity, 60000);
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST_F(DaemonTest, TenantsAreIsolated) {
  ASSERT_TRUE(client_->Put(MakePut("tiny", 21, 16, "alice")).ok());
  const auto tokens = synthetic::Tokens(21, 0, 16);
  EXPECT_EQ(client_->Match("tiny", "alice", tokens)->matched_tokens(), 16);
  EXPECT_EQ(client_->Match("tiny", "bob", tokens)->matched_tokens(), 0);
  auto bob = client_->OpenSequence("tiny", "bob", tokens);
  ASSERT_TRUE(bob.ok());
  EXPECT_EQ(bob->matched_tokens(), 0);
}

TEST_F(DaemonTest, EvictionUnderASmallBudget) {
  // 'cramped' holds 4 pages: the fifth prefix evicts the least recently used one.
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    auto r = client_->Put(MakePut("cramped", seed, 4));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(stats->evicted_pages(), 1u);
  EXPECT_EQ(client_->Match("cramped", "", synthetic::Tokens(1, 0, 4))->matched_tokens(), 0);
  EXPECT_EQ(client_->Match("cramped", "", synthetic::Tokens(5, 0, 4))->matched_tokens(), 4);
}

TEST_F(DaemonTest, ExpiredLeaseReleasesPins) {
  ASSERT_TRUE(client_->Put(MakePut("cramped", 9, 8)).ok());
  auto open = client_->OpenSequence("cramped", "", synthetic::Tokens(9, 0, 8), 30);
  ASSERT_TRUE(open.ok());
  // The client never renews: the daemon's reaper closes the sequence and unpins.
  EXPECT_TRUE(
      WaitFor([&] { return client_->Stats()->active_sequences() == 0; }, std::chrono::seconds(10)));
  auto stats = client_->Stats();
  EXPECT_EQ(stats->expired_leases(), 1u);
  EXPECT_EQ(client_->RenewLease(open->sequence_id()).status().code(), absl::StatusCode::kNotFound);
  // Unpinned: four more prefixes can now evict it.
  for (uint64_t seed = 30; seed < 34; ++seed)
    ASSERT_TRUE(client_->Put(MakePut("cramped", seed, 4)).ok());
  EXPECT_EQ(client_->Match("cramped", "", synthetic::Tokens(9, 0, 8))->matched_tokens(), 0);
}

// Sessions through the daemon (docs/sessions.md): turn 1 opens on the system prompt,
// appends its answer and closes with commit; turn 2 opens on turn 1's tokens plus a new
// message and matches everything turn 1 committed (page-aligned), reported as committed;
// a fork and a commit that keeps the sequence open; the metrics by origin.
TEST_F(DaemonTest, CommittedTurnIsReusedByTheNextTurn) {
  ASSERT_TRUE(client_->Put(MakePut("tiny", 21, 8)).ok());  // the system prompt: 2 pages
  const auto conversation = synthetic::Tokens(21, 0, 40);
  const auto prompt = absl::MakeConstSpan(conversation).subspan(0, 8);
  auto turn1 = client_->OpenSequence("tiny", "", prompt, 60000);
  ASSERT_TRUE(turn1.ok()) << turn1.status();
  EXPECT_EQ(turn1->matched_tokens(), 8);
  // The answer: 15 tokens (8 + 15 = 23: 5 full pages and 3 tokens).
  auto append = [&](uint64_t id, int64_t first, int64_t n) {
    v1::AppendRequest app;
    app.set_sequence_id(id);
    app.mutable_tokens()->Add(conversation.begin() + first, conversation.begin() + first + n);
    const std::vector<int64_t> shape = {profile_.num_layers(), n, profile_.num_kv_heads(),
                                        profile_.head_dim()};
    SetBf16FromFloat(app.mutable_k(), shape, synthetic::Kv(21, profile_, first, n, 0).data());
    SetBf16FromFloat(app.mutable_v(), shape, synthetic::Kv(21, profile_, first, n, 1).data());
    return client_->Append(app);
  };
  ASSERT_TRUE(append(turn1->sequence_id(), 8, 15).ok());
  auto closed = client_->CloseSequence(turn1->sequence_id(), /*commit=*/true);
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(closed->length(), 23);
  EXPECT_EQ(closed->commit().committed_tokens(), 20);
  EXPECT_EQ(closed->commit().inserted_pages(), 3);
  EXPECT_EQ(client_->CommitSequence(turn1->sequence_id()).status().code(),
            absl::StatusCode::kNotFound);

  // Turn 2: turn 1's 23 tokens and a 9-token message.
  const auto turn2_tokens = absl::MakeConstSpan(conversation).subspan(0, 32);
  auto m = client_->Match("tiny", "", turn2_tokens);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->matched_tokens(), 20);  // every committed page; the partial one was not
  EXPECT_EQ(m->committed_tokens(), 12);
  auto turn2 = client_->OpenSequence("tiny", "", turn2_tokens, 60000);
  ASSERT_TRUE(turn2.ok());
  EXPECT_EQ(turn2->matched_tokens(), 20);
  EXPECT_EQ(client_->Match("tiny", "other-tenant", turn2_tokens)->matched_tokens(), 0);
  ASSERT_TRUE(append(turn2->sequence_id(), 20, 12).ok());
  // The K/V turn 2 reads back are turn 1's, byte for byte, then its own.
  v1::FetchPagesRequest f;
  f.set_sequence_id(turn2->sequence_id());
  f.set_expand_to_bf16(true);
  auto fetched = client_->FetchPages(f);
  ASSERT_TRUE(fetched.ok());
  ASSERT_EQ(fetched->num_tokens(), 32);
  const int hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  for (int64_t t = 0; t < 32; ++t) {
    ASSERT_EQ(ElementAsFloat(fetched->k(), (32 + t) * hkv * d + 5),
              RoundBf16(synthetic::Value(21, 1, t, 0, 5, 0)))
        << t;
  }

  // A checkpoint that keeps turn 2 open, then a fork of it with its own lease.
  auto commit = client_->CommitSequence(turn2->sequence_id());
  ASSERT_TRUE(commit.ok()) << commit.status();
  EXPECT_EQ(commit->committed_tokens(), 32);
  EXPECT_EQ(commit->inserted_pages(), 3);
  auto fork = client_->ForkSequence(turn2->sequence_id(), 60000);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->length(), 32);
  EXPECT_EQ(fork->shared_pages(), 8);
  EXPECT_EQ(fork->lease_ms(), 60000);
  EXPECT_EQ(client_->ForkSequence(turn2->sequence_id(), -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->committed_pages(), 6u);
  EXPECT_EQ(stats->forks(), 1u);
  EXPECT_EQ(stats->hit_tokens_committed(), 12u);
  EXPECT_EQ(stats->hit_tokens_put() + stats->hit_tokens_committed(), stats->hit_tokens());
  EXPECT_EQ(stats->active_sequences(), 2u);
  ASSERT_TRUE(client_->CloseSequence(fork->sequence_id()).ok());
  ASSERT_TRUE(client_->CloseSequence(turn2->sequence_id()).ok());
  EXPECT_EQ(client_->Match("tiny", "", conversation)->matched_tokens(), 32);
}

TEST_F(DaemonTest, HealthMetricsAndDrain) {
  auto h = client_->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, grpc::health::v1::HealthCheckResponse::SERVING);
  // The health-only port answers too.
  ClientOptions ho;
  ho.target = daemon_.health();
  auto hc = Client::Connect(ho);
  ASSERT_TRUE(hc.ok());
  EXPECT_EQ(*(*hc)->Health(), grpc::health::v1::HealthCheckResponse::SERVING);

  ASSERT_TRUE(client_->Put(MakePut("tiny", 3, 8)).ok());
  // Scrape /metrics over plain HTTP.
  const std::string body = testing_util::ScrapeMetrics(daemon_);
  EXPECT_NE(body.find("200 OK"), std::string::npos);
  for (const char* name :
       {"kvcd_pool_bytes{format=\"bf16\",model=\"tiny\",state=\"used\"} 2048",
        "kvcd_pool_pages{format=\"bf16\",model=\"tiny\",state=\"used\"} 2",
        "kvcd_radix_miss_tokens_total 8", "kvcd_evicted_pages_total", "kvcd_active_sequences 0",
        "kvcd_rpc_duration_seconds_count{code=\"OK\",method=\"Put\"} 1",
        "kvcd_attention_kernel_seconds", "kvcd_history_bytes_per_element{model=\"tiny\"} 2",
        "kvcd_bytes_per_token{model=\"tiny\",segment=\"history\"} 256",
        "kvcd_pool_compression_ratio{model=\"tiny\"} 1", "kvcd_committed_pages{model=\"tiny\"} 0",
        "kvcd_forks_total 0", "kvcd_hit_tokens_by_origin_total{origin=\"put\"} 0",
        "kvcd_hit_tokens_by_origin_total{origin=\"committed\"} 0",
        "kvcd_evicted_pages_by_origin_total{origin=\"committed\"} 0"}) {
    EXPECT_NE(body.find(name), std::string::npos) << name;
  }
  EXPECT_EQ(daemon_.Stop(), 0);  // SIGTERM drains and exits 0
}

}  // namespace daemon_test
}  // namespace kvcd

namespace kvcd {
namespace daemon_test {

// RegisterModel with a codec file (safetensors rotations) over the wire; a model whose
// history is INT2 serves put -> open -> attend; a malformed codec file is rejected.
TEST_F(DaemonTest, RegisterInt2ModelWithACodecFile) {
  v1::ModelProfile p = profile_;
  p.set_name("tiny-oscar");
  p.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
  p.set_memory_bytes(1 << 20);
  p.set_bf16_fraction(0.5);
  // A codec file with a rotation per layer (Hadamard for K, identity for V).
  SafetensorsWriter w;
  const int d = p.head_dim();
  for (int l = 0; l < p.num_layers(); ++l) {
    w.AddF32("layers." + std::to_string(l) + ".r_k", {d, d}, HadamardMatrix(d));
    w.AddF32("layers." + std::to_string(l) + ".r_v", {d, d}, IdentityMatrix(d));
  }
  auto bad_profile = p;
  bad_profile.set_name("tiny-bad");
  auto bad = client_->RegisterModel(bad_profile, "not a safetensors file");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  SafetensorsWriter skewed;
  for (int l = 0; l < p.num_layers(); ++l) {
    std::vector<float> r = IdentityMatrix(d);
    r[1] = 0.5f;  // not orthogonal
    skewed.AddF32("layers." + std::to_string(l) + ".r_k", {d, d}, r);
    skewed.AddF32("layers." + std::to_string(l) + ".r_v", {d, d}, IdentityMatrix(d));
  }
  bad = client_->RegisterModel(bad_profile, skewed.Serialize());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("not orthogonal"), std::string::npos) << bad.status();

  auto info = client_->RegisterModel(p, w.Serialize());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->codec(), "oscar (registered codec)");
  EXPECT_EQ(info->history_bits_per_element(), 4.0);  // head_dim 16
  ASSERT_EQ(info->pools_size(), 2);
  EXPECT_EQ(info->pools(1).format(), "int2-oscar");

  profile_ = p;
  ASSERT_TRUE(client_->Put(MakePut("tiny-oscar", 5, 32)).ok());
  auto open = client_->OpenSequence("tiny-oscar", "", synthetic::Tokens(5, 0, 32));
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(open->matched_tokens(), 32);
  v1::AttentionDecodeRequest req;
  req.set_layer(1);
  req.add_sequence_ids(open->sequence_id());
  const auto q = synthetic::Row(5, p, 1, 32, 2);
  SetF32Tensor(req.mutable_q(), {1, p.num_q_heads(), d}, q.data());
  auto resp = client_->AttentionDecode(req);
  ASSERT_TRUE(resp.ok()) << resp.status();
  for (int i = 0; i < p.num_q_heads() * d; ++i)
    EXPECT_TRUE(std::isfinite(ElementAsFloat(resp->o(), i)));
  v1::FetchPagesRequest f;
  f.set_sequence_id(open->sequence_id());
  auto stored = client_->FetchPages(f);
  ASSERT_TRUE(stored.ok());
  ASSERT_EQ(stored->pages_size(), 8);
  EXPECT_EQ(stored->pages(0).format(), "bf16");  // the sink page
  EXPECT_EQ(stored->pages(1).format(), "int2-oscar");
}

// A decode node's daemon pulls a prefix from another tenant's pages as stored
// (FetchPages -> PushPages through the real client): INT2 pages stay INT2, attention over
// the pushed copy is bit-identical, and rejected pushes store nothing.
TEST_F(DaemonTest, FetchedPagesPushIntoAnotherTenant) {
  v1::ModelProfile int2 = profile_;
  int2.set_name("tiny-int2");
  int2.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
  int2.set_memory_bytes(1 << 20);
  int2.set_bf16_fraction(0.5);
  ASSERT_TRUE(client_->RegisterModel(int2).ok());  // no codec file: Hadamard
  for (const std::string model : {"tiny", "tiny-int2"}) {
    SCOPED_TRACE(model);
    ASSERT_TRUE(client_->Put(MakePut(model, 31, 32, "alice")).ok());
    const auto tokens = synthetic::Tokens(31, 0, 32);
    auto src = client_->OpenSequence(model, "alice", tokens, 60000);
    ASSERT_TRUE(src.ok()) << src.status();
    ASSERT_EQ(src->matched_tokens(), 32);
    v1::FetchPagesRequest f;
    f.set_sequence_id(src->sequence_id());
    auto fetched = client_->FetchPages(f);
    ASSERT_TRUE(fetched.ok()) << fetched.status();
    ASSERT_EQ(fetched->pages_size(), 8);
    EXPECT_EQ(fetched->pages(1).format(), model == "tiny" ? "bf16" : "int2-oscar");

    v1::PushPagesRequest push;
    push.set_model(model);
    push.set_cache_salt("bob");
    push.mutable_tokens()->Add(tokens.begin(), tokens.end());
    push.mutable_inline_pages()->CopyFrom(fetched->pages());

    // Rejected pushes: a truncated page, pages beyond the tokens, a gap before first_page.
    auto truncated = push;
    truncated.mutable_inline_pages(3)->mutable_data()->pop_back();
    auto r = client_->PushPages(truncated);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    auto beyond = push;
    beyond.set_first_page(1);
    r = client_->PushPages(beyond);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find("tokens has 32"), std::string::npos) << r.status();
    auto gap = push;
    gap.mutable_inline_pages()->DeleteSubrange(0, 2);
    gap.set_first_page(2);
    r = client_->PushPages(gap);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_EQ(client_->Match(model, "bob", tokens)->matched_tokens(), 0);

    auto inserted = client_->PushPages(push);
    ASSERT_TRUE(inserted.ok()) << inserted.status();
    EXPECT_EQ(*inserted, 32);
    EXPECT_EQ(client_->Match(model, "bob", tokens)->matched_tokens(), 32);
    auto dst = client_->OpenSequence(model, "bob", tokens, 60000);
    ASSERT_TRUE(dst.ok()) << dst.status();
    f.set_sequence_id(dst->sequence_id());
    auto again = client_->FetchPages(f);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(again->pages_size(), 8);
    for (int p = 0; p < 8; ++p) {
      EXPECT_EQ(again->pages(p).format(), fetched->pages(p).format());
      EXPECT_EQ(again->pages(p).data(), fetched->pages(p).data()) << "page " << p;
    }
    for (int32_t layer = 0; layer < profile_.num_layers(); ++layer) {
      v1::AttentionDecodeRequest a;
      a.set_layer(layer);
      a.add_sequence_ids(src->sequence_id());
      SetF32Tensor(a.mutable_q(), {1, profile_.num_q_heads(), profile_.head_dim()},
                   synthetic::Row(31, profile_, layer, 32, 2).data());
      auto from_src = client_->AttentionDecode(a);
      a.set_sequence_ids(0, dst->sequence_id());
      auto from_dst = client_->AttentionDecode(a);
      ASSERT_TRUE(from_src.ok() && from_dst.ok());
      EXPECT_EQ(from_src->o().inline_data(), from_dst->o().inline_data());
      EXPECT_EQ(from_src->lse().inline_data(), from_dst->lse().inline_data());
    }
    ASSERT_TRUE(client_->CloseSequence(src->sequence_id()).ok());
    ASSERT_TRUE(client_->CloseSequence(dst->sequence_id()).ok());
  }
}

}  // namespace daemon_test
}  // namespace kvcd
