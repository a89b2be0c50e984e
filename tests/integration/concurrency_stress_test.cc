// Integration: the daemon's locking under concurrency. Many client threads over a few gRPC
// channels run whole sessions at once against the real daemon — Put, Match, OpenSequence,
// Append, AttentionDecode (unary and stream), CommitSequence, ForkSequence, FetchPages,
// PinPrefix / UnpinPrefix, RenewLease, CloseSequence (with and without commit), Stats,
// ListModels — on a BF16 model whose small pool evicts all the time and on an INT2 model that
// demotes pages, while one thread registers models, one scrapes /metrics, and sequences and
// pins left behind with millisecond leases are expired by the daemon's reaper and sweep in
// the middle of it all. Every answer must be OK or one of the refusals the workload makes
// legitimate (a full pool, an id whose lease just ran out, a prefix just evicted); afterwards
// every abandoned sequence has been reaped, every pin swept, the pools hold exactly the
// cached prefixes, and the daemon drains cleanly. The ThreadSanitizer phase
// (scripts/test-lib.sh tsan_phase) runs this test against a TSan-built daemon.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "common/rotation.h"
#include "common/safetensors.h"
#include "daemon_process.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace concurrency_stress_test {

using testing_util::DaemonProcess;
using testing_util::ScrapeMetrics;
using testing_util::WaitFor;

constexpr char kConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
memory_budget: 32MiB
lease: {default_ms: 60000, max_ms: 600000}
max_pin_ttl_ms: 600000
drain_timeout_ms: 5000
models:
  - builtin: tiny
    memory: 192KiB   # 192 pages of 4 tokens: the Puts evict all the time
)";

constexpr int kThreads = 12, kConnections = 3, kRounds = 24, kRegistrations = 4;
constexpr int kPrefix = 16, kOwn = 8, kPrompt = kPrefix + kOwn, kAppend = 4;
constexpr int64_t kLongLeaseMs = 600000, kShortLeaseMs = 30;

enum Method {
  kPut,
  kMatch,
  kOpen,
  kAppendCall,
  kDecode,
  kStream,
  kCommit,
  kFork,
  kFetch,
  kPin,
  kUnpin,
  kRenew,
  kClose,
  kStats,
  kList,
  kRegister,
  kNumMethods
};
constexpr std::array<const char*, kNumMethods> kNames = {"Put",
                                                         "Match",
                                                         "OpenSequence",
                                                         "Append",
                                                         "AttentionDecode",
                                                         "AttentionDecodeStream",
                                                         "CommitSequence",
                                                         "ForkSequence",
                                                         "FetchPages",
                                                         "PinPrefix",
                                                         "UnpinPrefix",
                                                         "RenewLease",
                                                         "CloseSequence",
                                                         "Stats",
                                                         "ListModels",
                                                         "RegisterModel"};

// What every thread saw: per method, the OK answers, the legitimate refusals, and any other
// answer (with the first of them, to print).
struct Tally {
  std::array<std::atomic<int64_t>, kNumMethods> ok{}, refused{}, wrong{};
  std::mutex mu;
  std::string first_wrong;

  // Records `s`; `allowed` are the refusals the workload makes legitimate for this call.
  bool Record(Method m, const absl::Status& s, std::set<absl::StatusCode> allowed = {}) {
    if (s.ok()) {
      ok[m].fetch_add(1);
      return true;
    }
    if (allowed.count(s.code()) != 0) {
      refused[m].fetch_add(1);
      return false;
    }
    wrong[m].fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    if (first_wrong.empty()) first_wrong = std::string(kNames[m]) + ": " + s.ToString();
    return false;
  }
};

// The INT2 model's codec file: a rotation per layer (Hadamard for K, identity for V).
std::string OscarCodec(int layers, int d) {
  SafetensorsWriter w;
  for (int l = 0; l < layers; ++l) {
    w.AddF32("layers." + std::to_string(l) + ".r_k", {d, d}, HadamardMatrix(d));
    w.AddF32("layers." + std::to_string(l) + ".r_v", {d, d}, IdentityMatrix(d));
  }
  return w.Serialize();
}

// Request templates of one model: a prompt of kPrompt tokens (the first kPrefix shared by
// every session), an append of kAppend tokens, and a one-token query.
struct Templates {
  v1::ModelProfile profile;
  v1::PutRequest put;
  v1::AppendRequest append;
  v1::AttentionDecodeRequest decode;

  explicit Templates(const v1::ModelProfile& p) : profile(p) {
    constexpr uint64_t kSeed = 4242;
    put.set_model(p.name());
    const auto t = synthetic::Tokens(kSeed, 0, kPrompt);
    put.mutable_tokens()->Add(t.begin(), t.end());
    const std::vector<int64_t> shape = {p.num_layers(), kPrompt, p.num_kv_heads(), p.head_dim()};
    SetBf16FromFloat(put.mutable_k(), shape, synthetic::Kv(kSeed, p, 0, kPrompt, 0).data());
    SetBf16FromFloat(put.mutable_v(), shape, synthetic::Kv(kSeed, p, 0, kPrompt, 1).data());
    const auto a = synthetic::Tokens(kSeed, kPrompt, kAppend);
    append.mutable_tokens()->Add(a.begin(), a.end());
    const std::vector<int64_t> ashape = {p.num_layers(), kAppend, p.num_kv_heads(), p.head_dim()};
    SetBf16FromFloat(append.mutable_k(), ashape,
                     synthetic::Kv(kSeed, p, kPrompt, kAppend, 0).data());
    SetBf16FromFloat(append.mutable_v(), ashape,
                     synthetic::Kv(kSeed, p, kPrompt, kAppend, 1).data());
    SetF32Tensor(decode.mutable_q(), {1, p.num_q_heads(), p.head_dim()},
                 synthetic::Row(kSeed, p, 0, kPrompt, 2).data());
  }
};

class ConcurrencyStressTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start(kConfig));
    ClientOptions o;
    o.target = daemon_.grpc();
    // Generous: under ThreadSanitizer every call is many times slower.
    o.deadline = std::chrono::milliseconds(120000);
    for (int i = 0; i < kConnections; ++i) {
      auto c = Client::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status();
      clients_.push_back(std::move(*c));
    }
    auto tiny = clients_[0]->GetModel("tiny");
    ASSERT_TRUE(tiny.ok()) << tiny.status();
    v1::ModelProfile oscar = tiny->profile();
    oscar.set_name("tiny-oscar");
    oscar.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
    oscar.set_memory_bytes(1 << 20);
    oscar.set_bf16_fraction(0.5);
    auto info = clients_[0]->RegisterModel(oscar, OscarCodec(oscar.num_layers(), oscar.head_dim()));
    ASSERT_TRUE(info.ok()) << info.status();
    models_.emplace_back(tiny->profile());
    models_.emplace_back(info->profile());
  }

  // One thread's sessions.
  void Worker(int t) {
    Client& c = *clients_[t % kConnections];
    auto opened = c.OpenDecodeStream();
    if (!tally_.Record(kStream, opened.status())) return;
    std::unique_ptr<DecodeStream> stream = std::move(*opened);
    const std::set<absl::StatusCode> full = {absl::StatusCode::kResourceExhausted};
    const std::set<absl::StatusCode> gone = {absl::StatusCode::kNotFound};
    uint64_t abandoned = 0;  // last round's sequence left to the reaper
    for (int r = 0; r < kRounds; ++r) {
      const Templates& m = models_[(t + r) % 3 == 2 ? 1 : 0];
      const std::string& model = m.profile.name();
      v1::PutRequest put = m.put;
      for (int i = kPrefix; i < kPrompt; ++i) put.set_tokens(i, unique_.fetch_add(1));
      const std::vector<int32_t> prompt(put.tokens().begin(), put.tokens().end());
      const std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + kPrefix);

      tally_.Record(kPut, c.Put(put).status(), full);
      tally_.Record(kMatch, c.Match(model, "", prompt).status());
      // The sequence the reaper will close: renewed once with another millisecond lease,
      // which races with its expiry (NOT_FOUND once the reaper got there first).
      if (abandoned != 0) {
        tally_.Record(kRenew, c.RenewLease(abandoned, kShortLeaseMs).status(), gone);
        abandoned = 0;
      }
      if (r % 3 == 1) {
        auto left = c.OpenSequence(model, "", prompt, kShortLeaseMs);
        if (tally_.Record(kOpen, left.status(), full)) {
          abandoned = left->sequence_id();
          abandoned_.fetch_add(1);
        }
      }

      auto open = c.OpenSequence(model, "", prompt, kLongLeaseMs);
      if (!tally_.Record(kOpen, open.status(), full)) continue;
      const uint64_t seq = open->sequence_id();
      v1::AppendRequest append = m.append;
      append.set_sequence_id(seq);
      tally_.Record(kAppendCall, c.Append(append).status(), full);
      v1::AttentionDecodeRequest decode = m.decode;
      decode.add_sequence_ids(seq);
      decode.set_layer(r % m.profile.num_layers());
      tally_.Record(kDecode, c.AttentionDecode(decode).status());
      decode.set_layer((r + 1) % m.profile.num_layers());
      tally_.Record(kStream, stream->Call(decode).status());
      tally_.Record(kCommit, c.CommitSequence(seq).status(), full);
      auto fork = c.ForkSequence(seq, kLongLeaseMs);
      if (tally_.Record(kFork, fork.status(), full)) {
        v1::AppendRequest more = m.append;
        more.set_sequence_id(fork->sequence_id());
        tally_.Record(kAppendCall, c.Append(more).status(), full);
        tally_.Record(kClose, c.CloseSequence(fork->sequence_id(), r % 2 == 0).status(), full);
      }
      if (r % 4 == 0) {
        v1::FetchPagesRequest f;
        f.set_sequence_id(seq);
        tally_.Record(kFetch, c.FetchPages(f).status());
      }
      // A pin either removed at once or left for the sweep after a few milliseconds; the
      // prefix may have been evicted in between (NOT_FOUND).
      auto pin = c.PinPrefix(model, "", prefix, r % 2 == 0 ? kLongLeaseMs : 1 + r);
      if (tally_.Record(kPin, pin.status(), gone) && r % 2 == 0) {
        tally_.Record(kUnpin, c.UnpinPrefix(pin->pin_id()).status());
      }
      tally_.Record(kRenew, c.RenewLease(seq).status());
      tally_.Record(kClose, c.CloseSequence(seq).status());
      if (r % 5 == 0) tally_.Record(kStats, c.Stats().status());
      if (r % 7 == 0) tally_.Record(kList, c.ListModels().status());
    }
    tally_.Record(kStream, stream->Close());
  }

  DaemonProcess daemon_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<Templates> models_;
  Tally tally_;
  std::atomic<int32_t> unique_{1 << 24};
  std::atomic<int64_t> abandoned_{0};
};

TEST_F(ConcurrencyStressTest, SessionsRegistrationsReaperAndSweepAtOnce) {
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back([this, t] { Worker(t); });
  // Registrations while the sessions run (the engine's model table changes under them).
  threads.emplace_back([this] {
    for (int i = 0; i < kRegistrations; ++i) {
      v1::ModelProfile p = models_[0].profile;
      p.set_name("tiny-registered-" + std::to_string(i));
      p.set_memory_bytes(64 << 10);
      tally_.Record(kRegister, clients_[i % kConnections]->RegisterModel(p).status());
      tally_.Record(kList, clients_[i % kConnections]->ListModels().status());
    }
  });
  // /metrics read while everything changes.
  int scrapes = 0, empty_scrapes = 0;
  std::thread scraper([&] {
    while (!done.load()) {
      ++scrapes;
      if (ScrapeMetrics(daemon_).find("kvcd_") == std::string::npos) ++empty_scrapes;
    }
  });
  for (auto& t : threads) t.join();
  done.store(true);
  scraper.join();

  EXPECT_EQ(tally_.first_wrong, "") << "an answer that was neither OK nor a legitimate refusal";
  for (int m = 0; m < kNumMethods; ++m) {
    EXPECT_EQ(tally_.wrong[m].load(), 0) << kNames[m];
    EXPECT_GT(tally_.ok[m].load(), 0)
        << kNames[m] << ": never answered OK (" << tally_.refused[m].load() << " refused)";
  }
  EXPECT_EQ(tally_.ok[kRegister].load(), kRegistrations);
  EXPECT_GT(scrapes, 0);
  EXPECT_EQ(empty_scrapes, 0);
  ASSERT_GT(abandoned_.load(), 0);

  // The reaper closes every abandoned sequence; the sweep removes every pin left behind.
  Client& c = *clients_[0];
  ASSERT_TRUE(WaitFor(
      [&] {
        auto s = c.Stats();
        return s.ok() && s->active_sequences() == 0 && s->pins_size() == 0;
      },
      std::chrono::seconds(60)));
  auto stats = c.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->expired_leases(), static_cast<uint64_t>(abandoned_.load()));
  EXPECT_GT(stats->evicted_pages(), 0u);
  // Every pool back to idle: the pages in use are exactly those of the cached prefixes.
  int checked = 0;
  for (const auto& m : stats->models()) {
    uint64_t used = 0;
    for (const auto& pool : m.pools()) used += pool.pages_used();
    EXPECT_EQ(m.active_sequences(), 0u) << m.profile().name();
    EXPECT_EQ(used, m.cached_tokens() / static_cast<uint64_t>(m.profile().page_size()))
        << m.profile().name();
    ++checked;
  }
  EXPECT_EQ(checked, 2 + kRegistrations);
  clients_.clear();
  EXPECT_EQ(daemon_.Stop(), 0) << "the daemon did not drain cleanly";
}

}  // namespace concurrency_stress_test
}  // namespace kvcd
