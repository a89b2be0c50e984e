#include "examples/agent_conversation.h"

#include <functional>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "examples/served_conversation.h"

namespace kvcd::llama {
namespace {

// ChatML pieces. A finished turn ends with <|im_end|>; the next message starts with the
// newline that follows it.
std::string SystemTurn(const std::string& text) {
  return absl::StrCat("<|im_start|>system\n", text, "<|im_end|>\n");
}
std::string Message(const std::string& role, const std::string& text, bool first) {
  return absl::StrCat(first ? "" : "\n", "<|im_start|>", role, "\n", text,
                      "<|im_end|>\n<|im_start|>assistant\n");
}

// Pool bytes in use per token those pages hold (every page in use counted full).
absl::StatusOr<double> BytesPerToken(Client& client, const ServedProfile& p) {
  auto info = client.GetModel(p.name);
  if (!info.ok()) return info.status();
  double bytes = 0, pages = 0;
  for (const auto& pool : info->pools()) {
    bytes += static_cast<double>(pool.page_bytes()) * static_cast<double>(pool.pages_used());
    pages += static_cast<double>(pool.pages_used());
  }
  return pages > 0 ? bytes / (pages * info->profile().page_size()) : 0;
}

}  // namespace

AgentScript DefaultAgentScript() {
  AgentScript s;
  s.system =
      "You are a helpful assistant with access to one tool:\n"
      "<tools>[{\"name\": \"get_weather\", \"description\": \"The current weather of a city: "
      "temperature in degrees Celsius, sky, wind\", \"parameters\": {\"city\": {\"type\": "
      "\"string\", \"description\": \"the city's name\"}}}]</tools>\n"
      "To call it, answer with <tool_call>[{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\": \"...\"}}]</tool_call> and nothing else. When the tool's result comes back, "
      "answer the user in one or two short sentences.";
  s.question = "What is the weather in Paris right now?";
  // SmolLM2-135M does not emit this call reliably (it answers from its weights), so the
  // script holds the call and the turn feeds it as tokens.
  s.tool_call =
      "<tool_call>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]</tool_call>";
  s.tool_result =
      "{\"city\": \"Paris\", \"temperature\": 18, \"sky\": \"light rain\", "
      "\"wind\": \"12 km/h from the west\"}";
  s.follow_up = "Should I take an umbrella when I go out?";
  s.fork_follow_up = "Is it warm enough to wear a t-shirt?";
  s.question2 = "What is the weather in Tokyo?";
  return s;
}

absl::StatusOr<AgentResult> RunAgentConversation(Client& client, const Model& model,
                                                 const BpeTokenizer& tok, const ServedProfile& p,
                                                 const AgentScript& script,
                                                 const AgentOptions& options) {
  const Config& c = model.config();
  const int eos = tok.eos();
  const int max_new = options.max_new;
  AgentResult result;
  auto encode = [&](const std::string& text) { return tok.Encode(text); };
  // One table row from a conversation's turn.
  auto row = [&](const std::string& session, const std::string& what,
                 const ServedConversation& conv, int64_t held, int64_t message, const Turn& t,
                 bool scripted = false) -> absl::StatusOr<AgentTurn> {
    AgentTurn r;
    r.session = session;
    r.what = what;
    r.from_put = held == 0 ? conv.matched() - conv.matched_committed() : 0;
    r.from_committed = held == 0 ? conv.matched_committed() : 0;
    r.held = held;
    r.message = message;
    r.prefilled = t.prefilled;
    r.tokens = t.tokens;
    r.scripted = scripted;
    r.first_kl = t.kl.empty() ? 0 : t.kl.front();
    r.mean_kl = t.MeanKl();
    r.seconds = t.seconds;
    KVCD_ASSIGN_OR_RETURN(r.bytes_per_token, BytesPerToken(client, p));
    if (options.on_turn) options.on_turn(r);
    return r;
  };

  KVCD_ASSIGN_OR_RETURN(result.stats_before, client.Stats());
  // The prefill worker: the system prompt in FP32, Put (its full pages).
  const std::vector<int> system = encode(SystemTurn(script.system));
  LocalAttention system_fp32(c);
  KVCD_RETURN_IF_ERROR(model.ForwardTokens(system, 0, std::ref(system_fp32), nullptr));
  {
    const std::vector<int32_t> ids(system.begin(), system.end());
    auto put = PutRecorded(client, c, p, "", ids, system_fp32);
    if (!put.ok()) return put.status();
  }

  // Session 1: question -> tool call.
  const std::vector<int> question = encode(Message("user", script.question, true));
  std::vector<int> opening = system;
  opening.insert(opening.end(), question.begin(), question.end());
  KVCD_ASSIGN_OR_RETURN(auto s1,
                        ServedConversation::Open(&client, &model, p, "", opening, system_fp32));
  {
    const std::vector<int> call = encode(script.tool_call + "<|im_end|>");
    const bool scripted = !script.tool_call.empty();
    KVCD_ASSIGN_OR_RETURN(Turn t, s1->Run(max_new, eos, scripted ? &call : nullptr));
    KVCD_ASSIGN_OR_RETURN(AgentTurn r, row("1", "question -> tool call", *s1, 0,
                                           static_cast<int64_t>(question.size()), t, scripted));
    result.turns.push_back(std::move(r));
    KVCD_RETURN_IF_ERROR(s1->Finish(eos));
  }
  // The tool's result -> answer.
  {
    const std::vector<int> tool = encode(Message("tool", script.tool_result, false));
    const int64_t held = s1->held();
    s1->Add(tool);
    KVCD_ASSIGN_OR_RETURN(Turn t, s1->Run(max_new, eos));
    KVCD_ASSIGN_OR_RETURN(AgentTurn r, row("1", "tool result -> answer", *s1, held,
                                           static_cast<int64_t>(tool.size()), t));
    result.turns.push_back(std::move(r));
    KVCD_RETURN_IF_ERROR(s1->Finish(eos));
  }
  // The answer is checkpointed: CommitSequence puts the sequence's full pages in the prefix
  // cache and keeps the sequence open, so the session's next turn prefills only its message.
  KVCD_ASSIGN_OR_RETURN(result.checkpoint, s1->Commit());
  result.committed_history_tokens = result.checkpoint.committed_tokens();
  // A fork explores another follow-up later.
  KVCD_ASSIGN_OR_RETURN(auto fork, s1->Fork());
  const std::vector<int> history = s1->tokens();
  const LocalAttention history_fp32 = s1->reference();
  result.history_tokens = static_cast<int64_t>(history.size());

  // The follow-up in the open session: only the new message is prefilled.
  const std::vector<int> follow = encode(Message("user", script.follow_up, false));
  {
    const int64_t held = s1->held();
    s1->Add(follow);
    KVCD_ASSIGN_OR_RETURN(Turn t, s1->Run(max_new, eos));
    KVCD_ASSIGN_OR_RETURN(result.in_session, row("1", "follow-up in the open session", *s1, held,
                                                 static_cast<int64_t>(follow.size()), t));
    result.turns.push_back(result.in_session);
  }

  // The same follow-up on a new sequence opened on the committed history (a session resumed
  // elsewhere: the checkpoint's pages are served from the cache).
  std::vector<int> prompt = history;
  prompt.insert(prompt.end(), follow.begin(), follow.end());
  {
    KVCD_ASSIGN_OR_RETURN(auto s,
                          ServedConversation::Open(&client, &model, p, "", prompt, history_fp32));
    KVCD_ASSIGN_OR_RETURN(Turn t, s->Run(max_new, eos));
    KVCD_ASSIGN_OR_RETURN(result.committed,
                          row("1 resumed", "same follow-up on the committed history", *s, 0,
                              static_cast<int64_t>(follow.size()), t));
    result.turns.push_back(result.committed);
    // Fresh: the whole conversation prefilled in FP32 (the shadow fed it), Put under
    // another salt, opened there, teacher-forced on the same answer.
    const std::vector<int32_t> whole(prompt.begin(), prompt.end() - 1);
    auto put = PutRecorded(client, c, p, "fresh", whole, s->reference());
    if (!put.ok()) return put.status();
    KVCD_RETURN_IF_ERROR(s->Finish(eos));
    KVCD_RETURN_IF_ERROR(s->Close(/*commit=*/true).status());
    KVCD_ASSIGN_OR_RETURN(
        auto f, ServedConversation::Open(&client, &model, p, "fresh", prompt, history_fp32));
    KVCD_ASSIGN_OR_RETURN(Turn ft, f->Run(0, -1, &t.tokens));
    KVCD_ASSIGN_OR_RETURN(result.fresh, row("1 fresh", "same follow-up after a fresh FP32 Put", *f,
                                            0, static_cast<int64_t>(follow.size()), ft,
                                            /*scripted=*/true));
    result.turns.push_back(result.fresh);
    KVCD_RETURN_IF_ERROR(f->Close(/*commit=*/false).status());
  }

  // Session 1 ends: its follow-up finished, the sequence closed with commit.
  KVCD_RETURN_IF_ERROR(s1->Finish(eos));
  result.session_tokens = static_cast<int64_t>(s1->tokens().size());
  KVCD_ASSIGN_OR_RETURN(v1::CloseSequenceResponse closed, s1->Close(/*commit=*/true));
  result.close_commit = closed.commit();
  s1.reset();

  // The fork: another follow-up from the same point; only its message is prefilled.
  {
    const std::vector<int> other = encode(Message("user", script.fork_follow_up, false));
    const int64_t held = fork->held();
    fork->Add(other);
    KVCD_ASSIGN_OR_RETURN(Turn t, fork->Run(max_new, eos));
    KVCD_ASSIGN_OR_RETURN(AgentTurn r, row("1 fork", "another follow-up on a fork", *fork, held,
                                           static_cast<int64_t>(other.size()), t));
    result.turns.push_back(std::move(r));
    KVCD_RETURN_IF_ERROR(fork->Finish(eos));
    KVCD_RETURN_IF_ERROR(fork->Close(/*commit=*/true).status());
  }

  // Session 2: opens on the system prompt already in the cache.
  {
    const std::vector<int> q2 = encode(Message("user", script.question2, true));
    std::vector<int> open2 = system;
    open2.insert(open2.end(), q2.begin(), q2.end());
    KVCD_ASSIGN_OR_RETURN(auto s2,
                          ServedConversation::Open(&client, &model, p, "", open2, system_fp32));
    KVCD_ASSIGN_OR_RETURN(Turn t, s2->Run(max_new, eos));
    KVCD_ASSIGN_OR_RETURN(AgentTurn r, row("2", "question on the shared system prompt", *s2, 0,
                                           static_cast<int64_t>(q2.size()), t));
    result.turns.push_back(std::move(r));
    KVCD_RETURN_IF_ERROR(s2->Finish(eos));
    KVCD_RETURN_IF_ERROR(s2->Close(/*commit=*/true).status());
  }
  KVCD_ASSIGN_OR_RETURN(result.stats, client.Stats());
  return result;
}

}  // namespace kvcd::llama
