// One conversation of a llama-family model whose attention is served by a kvcd sequence,
// beside its FP32 shadow: the turn-by-turn unit of an agent loop. The conversation's tokens
// are held here; a turn adds a message's tokens (pending), feeds them one by one through the
// model with the fused append + AttentionDecode per layer (so the daemon computes their
// attention over the stored history, whatever its format, and keeps their K/V and token
// ids), then generates greedily. The same tokens go through the model with local FP32
// attention (the reference), and every generated step's next-token distributions are
// compared. The sequence can be committed to the prefix cache, forked and closed.
//
// Thread safety: none; one conversation per thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "examples/llama_model.h"
#include "examples/llama_worker.h"

namespace kvcd::llama {

// What one Run did.
struct Turn {
  int prefilled = 0;        // pending tokens fed before the first generated token
  std::vector<int> tokens;  // generated (or teacher-forced) tokens, in order
  std::vector<double> kl;   // KL(FP32 || served) of each step's next-token distribution
  double seconds = 0;       // wall time of the whole turn (prefill and steps)
  double MeanKl() const;
};

class ServedConversation {
 public:
  // Opens a sequence of model `p.name` (registered) under `salt` on `tokens`, the
  // conversation so far: the daemon holds its longest cached page-aligned prefix (the last
  // token is never taken from the cache: the next turn needs its logits); the rest is
  // pending. `reference` is the FP32 shadow, having fed a proper prefix of `tokens` (it
  // catches up as the turns run). Matched tokens are split by origin with Match (committed
  // vs Put). INVALID_ARGUMENT for empty tokens or a shadow that fed all of them; the
  // daemon's error otherwise.
  static absl::StatusOr<std::unique_ptr<ServedConversation>> Open(
      Client* client, const Model* model, const ServedProfile& p, const std::string& salt,
      std::vector<int> tokens, LocalAttention reference);
  ~ServedConversation();  // closes the sequence (no commit) if still open

  // Appends tokens to the conversation, pending until the next Run.
  void Add(const std::vector<int>& tokens);
  // Feeds the pending tokens, then generates greedily up to `max_new` tokens, stopping
  // after `stop` (-1: never); with `teacher`, its tokens are followed instead (max_new and
  // stop ignored). The last generated token joins the conversation unfed (pending).
  // INVALID_ARGUMENT without a pending token or past the model's context; the daemon's
  // error otherwise.
  absl::StatusOr<Turn> Run(int max_new, int stop, const std::vector<int>* teacher = nullptr);

  // Ends a turn: appends `end` (e.g. <|im_end|>) unless the conversation ends with it, and
  // feeds the pending tokens (K/V only), so that the sequence holds the whole turn. The
  // daemon's error.
  absl::Status Finish(int end);

  // CommitSequence: the sequence's full pages enter the prefix cache; it stays open.
  absl::StatusOr<v1::CommitSequenceResponse> Commit();
  // ForkSequence: a new conversation sharing the sequence's pages (its tokens, pending
  // tokens and FP32 shadow copied).
  absl::StatusOr<std::unique_ptr<ServedConversation>> Fork();
  // CloseSequence, committing first with `commit` (the response's `commit` then says what
  // entered the cache).
  absl::StatusOr<v1::CloseSequenceResponse> Close(bool commit);

  const std::vector<int>& tokens() const { return tokens_; }
  // Tokens the daemon's sequence holds (fed or taken from the cache).
  int64_t held() const { return fed_; }
  int64_t pending() const { return static_cast<int64_t>(tokens_.size()) - fed_; }
  // At Open: tokens served from the cache, and of those, tokens whose pages were committed.
  int64_t matched() const { return matched_; }
  int64_t matched_committed() const { return matched_committed_; }
  const LocalAttention& reference() const { return reference_; }
  uint64_t sequence_id() const { return sequence_; }

 private:
  ServedConversation(Client* client, const Model* model, ServedProfile p, LocalAttention reference)
      : client_(client), model_(model), profile_(std::move(p)), reference_(std::move(reference)) {}
  absl::Status Connect();  // opens the decode stream
  // Feeds the sequence and the FP32 shadow up to `to` tokens (each from where it stands:
  // the shadow's tokens alone in spans, the sequence's alone one by one, then each token
  // through both in one Model::Forward); the logits of each side's last feed where non-null.
  absl::Status FeedTo(int64_t to, std::vector<float>* served, std::vector<float>* fp32);
  // The attention of tokens_[pos] (`token`) served by the daemon: the fused append +
  // AttentionDecode per layer on the decode stream.
  Model::AttentionFn ServedAttention(int pos, int token);

  Client* client_;
  const Model* model_;
  ServedProfile profile_;
  LocalAttention reference_;
  std::vector<int> tokens_;
  int64_t fed_ = 0, matched_ = 0, matched_committed_ = 0;
  uint64_t sequence_ = 0;
  bool open_ = false;
  std::unique_ptr<DecodeStream> stream_;
};

}  // namespace kvcd::llama
