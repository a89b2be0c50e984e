#include "server/cluster/prefix_puller.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "server/cluster/peer_credentials.h"

namespace kvcd {
namespace {

// A peer's status, with what the pull was doing; the code is the peer's except that a
// transport failure is UNAVAILABLE.
absl::Status PeerError(const grpc::Status& s, const MemberInfo& peer, const char* call) {
  const absl::StatusCode code = static_cast<absl::StatusCode>(s.error_code());
  return absl::Status(
      code == absl::StatusCode::kDeadlineExceeded ? absl::StatusCode::kUnavailable : code,
      absl::StrCat("PullPrefix: peer ", peer.member_id, " (", peer.address, ") ", call, ": ",
                   s.error_message(), "; nothing was stored"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PrefixPuller>> PrefixPuller::Create(CacheEngine* engine,
                                                                   Membership* membership,
                                                                   const ServerConfig& config) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = PeerCredentials(config);
  if (!creds.ok()) return creds.status();
  return std::unique_ptr<PrefixPuller>(new PrefixPuller(engine, membership, config, *creds));
}

std::shared_ptr<grpc::Channel> PrefixPuller::ChannelTo(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(config_.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(config_.max_message_bytes));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto channel = grpc::CreateCustomChannel(address, creds_, args);
  if (channels_.size() >= 1024) channels_.clear();  // bounded: members come and go
  channels_.emplace(address, channel);
  return channel;
}

absl::Status PrefixPuller::Pull(const v1::PullPrefixRequest& req, const std::string& authorization,
                                v1::PullPrefixResponse* resp) {
  if (req.model().empty()) {
    return absl::InvalidArgumentError("PullPrefix: model is empty; expected a registered model");
  }
  if (req.tokens().empty()) {
    return absl::InvalidArgumentError("PullPrefix: tokens is empty; expected the prompt's ids");
  }
  if (!IsValidMemberId(req.peer_member_id())) {
    return absl::InvalidArgumentError(
        absl::StrCat("PullPrefix: peer_member_id ", Quote(req.peer_member_id()),
                     " is not a member id (1..128 of A-Z a-z 0-9 . _ -)"));
  }
  if (req.peer_member_id() == membership_->self().member_id) {
    return absl::InvalidArgumentError(absl::StrCat("PullPrefix: peer_member_id ",
                                                   Quote(req.peer_member_id()),
                                                   " is this daemon; name another member"));
  }
  // The model's page size, and what this daemon holds already.
  v1::ListModelsResponse models;
  if (absl::Status s = engine_->ListModels({}, &models); !s.ok()) return s;
  int32_t page_size = 0;
  for (const v1::ModelInfo& m : models.models()) {
    if (m.profile().name() == req.model()) page_size = m.profile().page_size();
  }
  if (page_size <= 0) {
    return absl::NotFoundError(absl::StrCat("PullPrefix: model ", Quote(req.model()),
                                            " is not registered; ListModels shows the models"));
  }
  v1::MatchRequest mreq;
  mreq.set_model(req.model());
  mreq.set_cache_salt(req.cache_salt());
  *mreq.mutable_tokens() = req.tokens();
  v1::MatchResponse mresp;
  if (absl::Status s = engine_->Match(mreq, &mresp); !s.ok()) return s;
  const std::optional<MemberInfo> peer = membership_->Find(req.peer_member_id());
  if (!peer) {
    return absl::NotFoundError(absl::StrCat("PullPrefix: no member ", Quote(req.peer_member_id()),
                                            " in the cluster (membership lists the live ones)"));
  }
  resp->set_local_tokens(mresp.matched_tokens());
  resp->set_peer_address(peer->address);
  absl::Status s = PullFrom(*peer, req, authorization, mresp.matched_tokens(), page_size, resp);
  if (s.ok()) {
    pulls_.fetch_add(1);
    pulled_bytes_.fetch_add(static_cast<uint64_t>(resp->pulled_bytes()));
  } else {
    failures_.fetch_add(1);
  }
  return s;
}

absl::Status PrefixPuller::PullFrom(const MemberInfo& peer, const v1::PullPrefixRequest& req,
                                    const std::string& authorization, int64_t local_tokens,
                                    int32_t page_size, v1::PullPrefixResponse* resp) {
  auto stub = v1::KvCache::NewStub(ChannelTo(peer.address));
  auto context = [&](grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (!authorization.empty()) ctx->AddMetadata("authorization", authorization);
  };
  v1::OpenSequenceRequest open;
  open.set_model(req.model());
  open.set_cache_salt(req.cache_salt());
  *open.mutable_tokens() = req.tokens();
  open.set_lease_ms(kPeerLeaseMs);
  v1::OpenSequenceResponse opened;
  {
    grpc::ClientContext ctx;
    context(&ctx);
    const grpc::Status s = stub->OpenSequence(&ctx, open, &opened);
    if (!s.ok()) return PeerError(s, peer, "OpenSequence");
  }
  const int64_t peer_tokens = opened.matched_tokens();
  // What the peer holds, page-aligned and within the request (a hostile peer may claim more).
  const int64_t held = std::min<int64_t>(peer_tokens, req.tokens_size()) / page_size * page_size;
  absl::Status status;
  v1::PushPagesRequest push;
  int64_t bytes = 0;
  for (int64_t first = local_tokens; status.ok() && first < held;
       first += kPagesPerFetch * page_size) {
    v1::FetchPagesRequest fetch;
    fetch.set_sequence_id(opened.sequence_id());
    fetch.set_first_token(first);
    fetch.set_num_tokens(std::min<int64_t>(held - first, kPagesPerFetch * page_size));
    fetch.set_expand_to_bf16(false);
    v1::FetchPagesResponse pages;
    grpc::ClientContext ctx;
    context(&ctx);
    const grpc::Status s = stub->FetchPages(&ctx, fetch, &pages);
    if (!s.ok()) {
      status = PeerError(s, peer, "FetchPages");
      break;
    }
    // The peer's answer must be exactly the pages asked for, in order.
    int64_t at = first;
    for (v1::StoredPage& p : *pages.mutable_pages()) {
      if (p.first_token() != at || p.num_tokens() != page_size) {
        status = absl::InvalidArgumentError(
            absl::StrCat("PullPrefix: peer ", peer.member_id, " answered a page of tokens [",
                         p.first_token(), ", +", p.num_tokens(), ") where [", at, ", +", page_size,
                         ") was expected; nothing was stored"));
        break;
      }
      bytes += static_cast<int64_t>(p.data().size());
      *push.add_inline_pages() = std::move(p);
      at += page_size;
    }
    if (status.ok() && at != first + fetch.num_tokens()) {
      status = absl::InvalidArgumentError(
          absl::StrCat("PullPrefix: peer ", peer.member_id, " answered ", (at - first) / page_size,
                       " page(s) where ", fetch.num_tokens() / page_size,
                       " were asked for; nothing was stored"));
    }
  }
  {
    v1::CloseSequenceRequest close;
    close.set_sequence_id(opened.sequence_id());
    v1::CloseSequenceResponse closed;
    grpc::ClientContext ctx;
    context(&ctx);
    (void)stub->CloseSequence(&ctx, close, &closed);  // else its short lease ends it
  }
  if (!status.ok()) return status;
  if (push.inline_pages_size() == 0) return absl::OkStatus();  // nothing beyond what is held
  push.set_model(req.model());
  push.set_cache_salt(req.cache_salt());
  push.mutable_tokens()->Assign(req.tokens().begin(), req.tokens().begin() + held);
  push.set_first_page(local_tokens / page_size);
  v1::PushPagesResponse pushed;
  if (absl::Status s = engine_->PushPages(push, &pushed); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("PullPrefix: the pages pulled from peer ",
                                               peer.member_id, " were refused: ", s.message()));
  }
  resp->set_pulled_tokens(pushed.inserted_tokens());
  resp->set_pulled_bytes(bytes);
  return absl::OkStatus();
}

}  // namespace kvcd
