#include "examples/served_conversation.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "proto/tensor_ref.h"

namespace kvcd::llama {

double Turn::MeanKl() const {
  double sum = 0;
  for (double k : kl) sum += k;
  return kl.empty() ? 0 : sum / static_cast<double>(kl.size());
}

absl::StatusOr<std::unique_ptr<ServedConversation>> ServedConversation::Open(
    Client* client, const Model* model, const ServedProfile& p, const std::string& salt,
    std::vector<int> tokens, LocalAttention reference) {
  if (tokens.empty()) return absl::InvalidArgumentError("a conversation needs at least one token");
  if (reference.tokens() >= static_cast<int>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("the FP32 shadow fed ", reference.tokens(),
                                                   " positions, expected fewer than the "
                                                   "conversation's ",
                                                   tokens.size()));
  }
  std::unique_ptr<ServedConversation> c(
      new ServedConversation(client, model, p, std::move(reference)));
  c->tokens_ = std::move(tokens);
  // The cache may serve all but the last token.
  const std::vector<int32_t> prefix(c->tokens_.begin(), c->tokens_.end() - 1);
  auto match = client->Match(p.name, salt, prefix);
  if (!match.ok()) return match.status();
  auto open = client->OpenSequence(p.name, salt, prefix);
  if (!open.ok()) return open.status();
  c->sequence_ = open->sequence_id();
  c->open_ = true;
  c->fed_ = c->matched_ = open->matched_tokens();
  // Match and OpenSequence saw the same tree unless another client changed it in between;
  // the committed share is capped by what the open matched.
  c->matched_committed_ = std::min(match->committed_tokens(), c->matched_);
  if (auto s = c->Connect(); !s.ok()) return s;
  return c;
}

ServedConversation::~ServedConversation() {
  if (stream_ != nullptr) stream_->Close().IgnoreError();
  if (open_) client_->CloseSequence(sequence_).status().IgnoreError();
}

absl::Status ServedConversation::Connect() {
  auto stream = client_->OpenDecodeStream();
  if (!stream.ok()) return stream.status();
  stream_ = std::move(*stream);
  return absl::OkStatus();
}

void ServedConversation::Add(const std::vector<int>& tokens) {
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
}

Model::AttentionFn ServedConversation::ServedAttention(int pos, int token) {
  return [this, pos, token](int layer, int, const float* x, const float* q, const float* k,
                            const float* v, float* o) -> absl::Status {
    const Config& c = model_->config();
    v1::AttentionDecodeRequest req;
    req.set_layer(layer);
    req.add_sequence_ids(sequence_);
    req.set_request_id(static_cast<uint64_t>(pos) * 1000 + static_cast<uint64_t>(layer));
    SetF32Tensor(req.mutable_q(), {1, c.n_heads, c.head_dim}, q);
    SetF32Tensor(req.mutable_k_new(), {1, c.n_kv_heads, c.head_dim}, k);
    SetF32Tensor(req.mutable_v_new(), {1, c.n_kv_heads, c.head_dim}, v);
    if (profile_.history == "fsq") SetF32Tensor(req.mutable_x_new(), {1, c.dim}, x);
    req.add_new_tokens(token);
    auto resp = stream_->Call(req);
    if (!resp.ok()) return resp.status();
    CopyAsFloat(resp->o(), 0, c.q_dim(), o);
    return absl::OkStatus();
  };
}

absl::Status ServedConversation::FeedTo(int64_t to, std::vector<float>* served,
                                        std::vector<float>* fp32) {
  // Positions [both, to) go through the sequence and the shadow; below `both`, one of them
  // is behind the other.
  const int64_t shadow = reference_.tokens();
  const int64_t both = std::min<int64_t>(std::max<int64_t>(shadow, fed_), to);
  // The shadow behind the sequence (e.g. a message the cache served): local attention takes
  // the tokens in spans.
  if (shadow < both) {
    const absl::Span<const int> span(tokens_.data() + shadow, static_cast<size_t>(both - shadow));
    KVCD_RETURN_IF_ERROR(model_->ForwardTokens(span, static_cast<int>(shadow), std::ref(reference_),
                                               both == to ? fp32 : nullptr));
  }
  // The sequence behind the shadow (a partial page the cache did not hold): kvcd's fused
  // append takes one token's layers at a time.
  while (fed_ < both) {
    const int pos = static_cast<int>(fed_);
    const Model::AttentionFn attend = ServedAttention(pos, tokens_[static_cast<size_t>(pos)]);
    KVCD_RETURN_IF_ERROR(model_->Forward(tokens_[static_cast<size_t>(pos)], pos, attend,
                                         fed_ + 1 == to ? served : nullptr));
    ++fed_;
  }
  // Then each token through both at once: one pass over the weights for the two vectors.
  const Model::AttentionFn local = std::ref(reference_);
  while (fed_ < to) {
    const int pos = static_cast<int>(fed_);
    const int token = tokens_[static_cast<size_t>(pos)];
    const Model::AttentionFn attend = ServedAttention(pos, token);
    const bool last = fed_ + 1 == to;
    const Model::Step steps[2] = {{token, pos, &attend, last ? served : nullptr},
                                  {token, pos, &local, last ? fp32 : nullptr}};
    KVCD_RETURN_IF_ERROR(model_->Forward(steps));
    ++fed_;
  }
  return absl::OkStatus();
}

absl::StatusOr<Turn> ServedConversation::Run(int max_new, int stop,
                                             const std::vector<int>* teacher) {
  const auto t0 = std::chrono::steady_clock::now();
  const int steps = teacher != nullptr ? static_cast<int>(teacher->size()) : max_new;
  const int64_t total = static_cast<int64_t>(tokens_.size()) + steps - 1;
  if (pending() < 1 || reference_.tokens() >= static_cast<int>(tokens_.size()) || steps < 1 ||
      total > model_->config().max_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("a turn needs a pending token and a step within the model's context of ",
                     model_->config().max_seq_len, " positions (", tokens_.size(), " tokens, ",
                     pending(), " pending, ", steps, " steps)"));
  }
  Turn turn;
  turn.prefilled = static_cast<int>(pending());
  for (int i = 0; i < steps; ++i) {
    // The first step feeds the pending tokens, each step its token.
    const int64_t n = static_cast<int64_t>(tokens_.size());
    std::vector<float> served, fp32;
    if (auto s = FeedTo(n, &served, &fp32); !s.ok()) return s;
    turn.kl.push_back(KlDivergence(fp32, served));
    const int next = teacher != nullptr ? (*teacher)[static_cast<size_t>(i)] : Argmax(served);
    turn.tokens.push_back(next);
    tokens_.push_back(next);
    if (teacher == nullptr && next == stop) break;
  }
  turn.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return turn;
}

absl::Status ServedConversation::Finish(int end) {
  if (tokens_.back() != end) tokens_.push_back(end);
  const int64_t n = static_cast<int64_t>(tokens_.size());
  return FeedTo(n, nullptr, nullptr);
}

absl::StatusOr<v1::CommitSequenceResponse> ServedConversation::Commit() {
  return client_->CommitSequence(sequence_);
}

absl::StatusOr<std::unique_ptr<ServedConversation>> ServedConversation::Fork() {
  auto forked = client_->ForkSequence(sequence_);
  if (!forked.ok()) return forked.status();
  std::unique_ptr<ServedConversation> c(
      new ServedConversation(client_, model_, profile_, reference_));
  c->tokens_ = tokens_;
  c->sequence_ = forked->sequence_id();
  c->open_ = true;
  c->fed_ = forked->length();
  c->matched_ = 0;
  c->matched_committed_ = 0;
  if (c->fed_ != fed_) {
    return absl::InternalError(
        absl::StrCat("the fork holds ", c->fed_, " tokens, its source ", fed_));
  }
  if (auto s = c->Connect(); !s.ok()) return s;
  return c;
}

absl::StatusOr<v1::CloseSequenceResponse> ServedConversation::Close(bool commit) {
  if (stream_ != nullptr) {
    absl::Status s = stream_->Close();
    stream_.reset();
    if (!s.ok()) return s;
  }
  auto closed = client_->CloseSequence(sequence_, commit);
  if (closed.ok()) open_ = false;  // a failed commit leaves the sequence open
  return closed;
}

}  // namespace kvcd::llama
