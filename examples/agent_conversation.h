// The agent conversation of the main job: a llama-family chat model (SmolLM2-Instruct's
// ChatML) in two sessions that share one system prompt with a tool's description, with
// its attention served by kvcd (examples/served_conversation.h):
//
//   prefill worker  the system prompt, prefilled in FP32 and Put (the shared prefix)
//   session 1       question -> tool call; the tool's result -> answer; the sequence is
//                   committed (CommitSequence: its full pages enter the prefix cache, it
//                   stays open) and forked
//   session 1       a follow-up question in the open session: only the message is prefilled
//   resumed         the same follow-up on a new sequence opened on the committed history
//   fresh           the same follow-up after a fresh FP32 prefill of the whole conversation
//                   (Put under another salt, then opened), teacher-forced on the tokens the
//                   resumed run generated: the measured outcome compares the two; session 1
//                   is then closed with commit
//   session 1 fork  a second follow-up explored on the fork
//   session 2       another question, opened on the system prompt already in the cache
//
// Every turn is greedy and compared step by step with the FP32 reference of the same
// tokens (next-token KL); every finished turn is fed to the end (its <|im_end|> included)
// so that a sequence holds whole turns.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "examples/bpe_tokenizer.h"
#include "examples/llama_model.h"
#include "examples/llama_worker.h"

namespace kvcd::llama {

struct AgentScript {
  std::string system;          // system prompt with the tool's description (shared)
  std::string question;        // session 1's first user message (asks for the tool)
  std::string tool_call;       // non-empty: the assistant's tool call, fed as tokens
                               // instead of generated
  std::string tool_result;     // the tool's answer (ChatML role "tool")
  std::string follow_up;       // session 1's next question, on the committed history
  std::string fork_follow_up;  // the question explored on the fork
  std::string question2;       // session 2's question
};
// The script the main job runs (a weather tool; the tool call scripted).
AgentScript DefaultAgentScript();

struct AgentTurn;
struct AgentOptions {
  int max_new = 24;  // tokens generated per turn at most
  // Called with each turn as it finishes (progress), if set.
  std::function<void(const AgentTurn&)> on_turn;
};

// One row of the per-turn table.
struct AgentTurn {
  std::string session, what;
  int64_t from_put = 0;              // served from the cache at open: pages stored by Put
  int64_t from_committed = 0;        // ... pages that entered by a commit
  int64_t held = 0;                  // already in the (open or forked) sequence
  int64_t message = 0;               // the new message's tokens
  int64_t prefilled = 0;             // tokens fed before the first generated one (message
                                     // included; the rest: a partial page the cache cannot hold)
  std::vector<int> tokens;           // generated (or, scripted / teacher-forced, followed)
  bool scripted = false;             // tokens fed from the script, not generated
  double first_kl = 0, mean_kl = 0;  // KL(FP32 || served), first step and mean over steps
  double bytes_per_token = 0;        // the model's pool bytes in use / tokens those pages hold
  double seconds = 0;
};

struct AgentResult {
  std::vector<AgentTurn> turns;
  // The follow-up in the open session after the checkpoint, and the measured outcome: the
  // same follow-up on a new sequence opened on the committed history and after a fresh
  // prefill (all three also in `turns`); the history's length at the checkpoint and its
  // page-aligned part in the tree, and session 1's length when it closed.
  AgentTurn in_session, committed, fresh;
  int64_t history_tokens = 0, committed_history_tokens = 0, session_tokens = 0;
  v1::CommitSequenceResponse checkpoint;    // session 1's CommitSequence after the answer
  v1::CommitSequenceResponse close_commit;  // session 1's CloseSequence(commit) at the end
  v1::StatsResponse stats_before, stats;    // the daemon's, before and after
};

// Runs the conversation against model `p.name` (registered with `p`'s page size) on the
// daemon behind `client`. The model must not have served this script before (the cache
// counts would differ). The daemon's or the model's error.
absl::StatusOr<AgentResult> RunAgentConversation(Client& client, const Model& model,
                                                 const BpeTokenizer& tok, const ServedProfile& p,
                                                 const AgentScript& script,
                                                 const AgentOptions& options = {});

}  // namespace kvcd::llama
