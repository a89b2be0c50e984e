// The agent conversation (examples/agent_conversation.h) on SmolLM2-135M-Instruct with its
// attention served by the real daemon (CPU backend): what the cache serves at each turn, and
// the measured outcome — a follow-up turn in the session after a CommitSequence
// checkpoint prefills only the new message; the same turn on a new sequence opened on the
// committed history prefills the message and the history's last partial page (which a
// commit leaves with the sequence), and its next-token KL against FP32 is within 10% of the
// same turn after a fresh FP32 prefill of the whole conversation in the same history format.
#include "examples/agent_conversation.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "daemon_process.h"
#include "examples/bpe_tokenizer.h"
#include "examples/llama_worker.h"

namespace kvcd {
namespace agent_conversation_test {

using testing_util::DaemonProcess;

std::string ModelDir() {
  const char* env = std::getenv("KVCD_MODEL_CACHE");
  return std::string(env != nullptr ? env : KVCD_MODEL_CACHE) + "/smollm2-135m-instruct";
}

constexpr int kPage = 16;
// The measured outcome's bound: KL(committed) <= (1 + 10%) KL(fresh).
constexpr double kKlRatio = 1.10;

class AgentConversationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::ifstream(ModelDir() + "/model.safetensors").good()) return;
    auto m = llama::Model::Load(ModelDir() + "/model.safetensors");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = new llama::Model(std::move(*m));
    auto t = llama::BpeTokenizer::Load(ModelDir() + "/tokenizer.txt");
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = new llama::BpeTokenizer(std::move(*t));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tok_;
    model_ = nullptr;
    tok_ = nullptr;
  }

  void SetUp() override {
    if (model_ == nullptr) {
      GTEST_SKIP() << "no SmolLM2 at " << ModelDir() << ": run scripts/fetch-smollm2.sh";
    }
    ASSERT_TRUE(
        daemon_.Start("listen: 127.0.0.1:0\nmetrics_listen: \"\"\nmemory_budget: 512MiB\n"
                      "drain_timeout_ms: 300\n"));
    ClientOptions o;
    o.target = daemon_.grpc();
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }

  int64_t Tokens(const std::string& text) {
    return static_cast<int64_t>(tok_->Encode(text).size());
  }

  // Runs the conversation on `p` and checks every turn's token accounting and the
  // measured outcome.
  void RunAndCheck(llama::ServedProfile p) {
    p.page_size = kPage;
    p.sink_tokens = 16;
    p.recent_tokens = 32;
    p.memory_bytes = int64_t{128} << 20;
    ASSERT_TRUE(llama::RegisterProfile(*client_, model_->config(), p).ok());
    const llama::AgentScript script = llama::DefaultAgentScript();
    auto r = llama::RunAgentConversation(*client_, *model_, *tok_, p, script);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->turns.size(), 7u);
    for (const auto& t : r->turns) {
      std::printf(
          "%s | %-8s %-40s put %3lld committed %3lld held %3lld message %3lld "
          "prefilled %3lld gen %2zu KL first %.3g mean %.3g B/token %.0f\n",
          p.name.c_str(), t.session.c_str(), t.what.c_str(), static_cast<long long>(t.from_put),
          static_cast<long long>(t.from_committed), static_cast<long long>(t.held),
          static_cast<long long>(t.message), static_cast<long long>(t.prefilled), t.tokens.size(),
          t.first_kl, t.mean_kl, t.bytes_per_token);
      EXPECT_FALSE(t.tokens.empty()) << t.what;
    }
    const int64_t system = Tokens("<|im_start|>system\n" + script.system + "<|im_end|>\n");
    const int64_t system_pages = system / kPage * kPage;
    // Session 1 opens on the Put system prompt and prefills the rest of its first prompt.
    const llama::AgentTurn& first = r->turns[0];
    EXPECT_EQ(first.from_put, system_pages);
    EXPECT_EQ(first.from_committed, 0);
    EXPECT_EQ(first.prefilled, system + first.message - system_pages);
    // The tool's result on the open sequence: only the message is fed.
    const llama::AgentTurn& tool = r->turns[1];
    EXPECT_GT(tool.held, system + first.message);
    EXPECT_EQ(tool.prefilled, tool.message);
    // The checkpoint (CommitSequence) put the history's full pages in the tree.
    const int64_t history = r->history_tokens;
    EXPECT_EQ(r->committed_history_tokens, history / kPage * kPage);
    EXPECT_EQ(r->checkpoint.committed_tokens(), history / kPage * kPage);
    EXPECT_GT(r->checkpoint.inserted_pages(), 0);
    // The follow-up in the open session: it holds the whole history and prefills only the
    // new message.
    const llama::AgentTurn& in_session = r->in_session;
    EXPECT_EQ(in_session.held, history);
    EXPECT_EQ(in_session.from_put + in_session.from_committed, 0);
    EXPECT_EQ(in_session.message, Tokens("\n<|im_start|>user\n" + script.follow_up +
                                         "<|im_end|>\n<|im_start|>assistant\n"));
    EXPECT_EQ(in_session.prefilled, in_session.message);
    // Session 1's close with commit put its whole conversation's full pages in the tree.
    EXPECT_GT(r->session_tokens, history + in_session.message);
    EXPECT_EQ(r->close_commit.committed_tokens(), r->session_tokens / kPage * kPage);
    // The same follow-up on a new sequence opens on the whole committed history: Put pages
    // (the system prompt's) and committed pages; it prefills the message and the history's
    // partial last page.
    const llama::AgentTurn& committed = r->committed;
    EXPECT_EQ(committed.from_put, system_pages);
    EXPECT_EQ(committed.from_put + committed.from_committed, history / kPage * kPage);
    EXPECT_EQ(committed.prefilled, committed.message + history % kPage);
    EXPECT_LT(committed.prefilled - committed.message, kPage);
    // Fresh: everything but the last partial page came from the Put.
    const llama::AgentTurn& fresh = r->fresh;
    const int64_t whole = history + committed.message;
    EXPECT_EQ(fresh.from_put, (whole - 1) / kPage * kPage);
    EXPECT_EQ(fresh.from_committed, 0);
    EXPECT_EQ(fresh.prefilled, whole - fresh.from_put);
    ASSERT_EQ(fresh.tokens, committed.tokens);  // teacher-forced on the resumed run
    // The fork holds the whole history and prefills only its message.
    const llama::AgentTurn& fork = r->turns[5];
    EXPECT_EQ(fork.held, history);
    EXPECT_EQ(fork.prefilled, fork.message);
    // Session 2 opens on the system prompt already in the cache (and on any committed
    // page of session 1 that its prompt shares: the system prompt's tail and the start of
    // the user turn can fill one).
    const llama::AgentTurn& second = r->turns[6];
    const std::vector<int> prompt2 =
        tok_->Encode("<|im_start|>system\n" + script.system + "<|im_end|>\n<|im_start|>user\n" +
                     script.question2 + "<|im_end|>\n<|im_start|>assistant\n");
    const std::vector<int> history1 =
        tok_->Encode("<|im_start|>system\n" + script.system + "<|im_end|>\n<|im_start|>user\n" +
                     script.question + "<|im_end|>\n");
    size_t common = 0;
    while (common + 1 < prompt2.size() && common < history1.size() &&
           prompt2[common] == history1[common]) {
      ++common;
    }
    const int64_t shared_pages = static_cast<int64_t>(common) / kPage * kPage;
    EXPECT_EQ(second.from_put, system_pages);
    EXPECT_EQ(second.from_committed, std::max<int64_t>(0, shared_pages - system_pages));
    EXPECT_EQ(second.prefilled,
              static_cast<int64_t>(prompt2.size()) - second.from_put - second.from_committed);
    EXPECT_GE(r->stats.forks(), 1u);
    EXPECT_GE(r->stats.hit_tokens_committed(), static_cast<uint64_t>(committed.from_committed));
    // The measured outcome.
    std::printf("%s: follow-up KL mean committed %.4g, fresh %.4g, ratio %.3f\n", p.name.c_str(),
                committed.mean_kl, fresh.mean_kl, committed.mean_kl / fresh.mean_kl);
    EXPECT_LE(committed.mean_kl, kKlRatio * fresh.mean_kl);
  }

  static llama::Model* model_;
  static llama::BpeTokenizer* tok_;
  DaemonProcess daemon_;
  std::unique_ptr<Client> client_;
};

llama::Model* AgentConversationTest::model_ = nullptr;
llama::BpeTokenizer* AgentConversationTest::tok_ = nullptr;

TEST_F(AgentConversationTest, Bf16FollowUpOnCommittedHistoryMatchesFreshPrefill) {
  llama::ServedProfile p;
  p.name = "agent-bf16";
  RunAndCheck(p);
}

// int2-transform: the codec calibrated in process on the first 160 tokens of
// bench/text/smollm2-calibration.txt (rows past the 16-token sink), as smollm2_test does.
TEST_F(AgentConversationTest, Int2TransformFollowUpOnCommittedHistoryMatchesFreshPrefill) {
  std::ifstream in(std::string(KVCD_SOURCE_DIR) + "/bench/text/smollm2-calibration.txt");
  std::string text;
  ASSERT_TRUE(std::getline(in, text));
  std::vector<int> ids = tok_->Encode(text);
  ASSERT_GT(ids.size(), 160u);
  ids.resize(160);
  llama::LocalAttention calib(model_->config());
  ASSERT_TRUE(llama::RunReference(*model_, ids, 1, -1, &calib).ok());
  auto p = llama::ResolveHistory("int2-transform", *model_, {&calib}, nullptr, 16);
  ASSERT_TRUE(p.ok()) << p.status();
  p->name = "agent-int2-transform";
  RunAndCheck(*p);
}

}  // namespace agent_conversation_test
}  // namespace kvcd
