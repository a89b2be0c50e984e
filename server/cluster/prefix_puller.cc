#include "server/cluster/prefix_puller.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/cluster/device_page_pull.h"
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
  // The pages to store here: tokens [local_tokens, held) of the request.
  v1::PushPagesRequest push;
  push.set_model(req.model());
  push.set_cache_salt(req.cache_salt());
  if (held > local_tokens) {
    push.mutable_tokens()->Assign(req.tokens().begin(), req.tokens().begin() + held);
    push.set_first_page(local_tokens / page_size);
    push.set_num_pages((held - local_tokens) / page_size);
  }
  // A FetchPages answer must be exactly the pages asked for, in order.
  auto check = [&](int64_t first, int64_t num_tokens,
                   const v1::FetchPagesResponse& pages) -> absl::Status {
    int64_t at = first;
    for (const v1::StoredPage& p : pages.pages()) {
      if (p.first_token() != at || p.num_tokens() != page_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("PullPrefix: peer ", peer.member_id, " answered a page of tokens [",
                         p.first_token(), ", +", p.num_tokens(), ") where [", at, ", +", page_size,
                         ") was expected; nothing was stored"));
      }
      at += page_size;
    }
    if (at != first + num_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PullPrefix: peer ", peer.member_id, " answered ", (at - first) / page_size,
          " page(s) where ", num_tokens / page_size, " were asked for; nothing was stored"));
    }
    return absl::OkStatus();
  };
  // Each page's bytes as this daemon stores it (sizes the fetches and the device chunks).
  std::vector<int64_t> page_bytes;
  absl::Status status;
  for (int64_t i = 0; status.ok() && i < push.num_pages(); ++i) {
    v1::PushPagesRequest one;
    one.set_model(req.model());
    *one.mutable_tokens() = push.tokens();
    one.set_first_page(push.first_page() + i);
    one.set_num_pages(1);
    absl::StatusOr<int64_t> b = engine_->StoredPagesBytes(one);
    if (b.ok()) page_bytes.push_back(*b);
    status = b.status();
  }
  v1::PushPagesResponse pushed;
  int64_t bytes = 0;
  std::optional<PullTransport> used;

  // Over gRPC: the pages inline in FetchPages' answers, as many per call as fit a message.
  auto by_grpc = [&]() -> absl::Status {
    const int64_t largest = *std::max_element(page_bytes.begin(), page_bytes.end());
    const int64_t per_fetch = std::clamp<int64_t>(
        (static_cast<int64_t>(config_.max_message_bytes) - (int64_t{1} << 20)) / largest, 1,
        kPagesPerFetch);
    v1::PushPagesRequest inline_push;
    inline_push.set_model(push.model());
    inline_push.set_cache_salt(push.cache_salt());
    *inline_push.mutable_tokens() = push.tokens();
    inline_push.set_first_page(push.first_page());
    for (int64_t first = local_tokens; first < held; first += per_fetch * page_size) {
      v1::FetchPagesRequest fetch;
      fetch.set_sequence_id(opened.sequence_id());
      fetch.set_first_token(first);
      fetch.set_num_tokens(std::min<int64_t>(held - first, per_fetch * page_size));
      fetch.set_expand_to_bf16(false);
      v1::FetchPagesResponse pages;
      grpc::ClientContext ctx;
      context(&ctx);
      const grpc::Status s = stub->FetchPages(&ctx, fetch, &pages);
      if (!s.ok()) return PeerError(s, peer, "FetchPages");
      KVCD_RETURN_IF_ERROR(check(first, fetch.num_tokens(), pages));
      for (v1::StoredPage& p : *pages.mutable_pages()) {
        bytes += static_cast<int64_t>(p.data().size());
        *inline_push.add_inline_pages() = std::move(p);
      }
    }
    if (absl::Status s = engine_->PushPages(inline_push, &pushed); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("PullPrefix: the pages pulled from peer ",
                                                 peer.member_id, " were refused: ", s.message()));
    }
    return absl::OkStatus();
  };

  // Over CUDA IPC or NCCL: the peer writes the pages into this daemon's device staging.
  auto by_device = [&](PullTransport t, bool* stored) -> absl::Status {
    DevicePagePull::Request d;
    d.peer = stub.get();
    d.context = context;
    d.sequence_id = static_cast<uint64_t>(opened.sequence_id());
    d.name = absl::StrCat("pull by ", membership_->self().member_id);
    d.lease_ms = kPeerLeaseMs;
    // A failed NCCL join or transfer gives up well within the peer sequence's lease, so
    // that the next transport still finds the sequence open.
    d.timeout_ms = static_cast<int>(kPeerLeaseMs / 2);
    // One chunk for CUDA IPC (one region); NCCL transfers of at most kMaxNcclChunkBytes.
    const int64_t limit = t == PullTransport::kCudaIpc ? DevicePagePull::kMaxPullBytes
                                                       : DevicePagePull::kMaxNcclChunkBytes;
    for (size_t i = 0; i < page_bytes.size(); ++i) {
      const int64_t first = local_tokens + static_cast<int64_t>(i) * page_size;
      if (d.chunks.empty() || d.chunks.back().bytes + page_bytes[i] > limit) {
        d.chunks.push_back({first, 0, 0});
      }
      d.chunks.back().num_tokens += page_size;
      d.chunks.back().bytes += page_bytes[i];
    }
    d.check = [&](const DevicePagePull::Chunk& c, const v1::FetchPagesResponse& pages) {
      return check(c.first_token, c.num_tokens, pages);
    };
    d.store = [&](const uint8_t* device_pages, int64_t n) -> absl::Status {
      bytes = n;
      return engine_->PushPagesFromDevice(push, device_pages, n, &pushed);
    };
    absl::Status s = t == PullTransport::kCudaIpc ? DevicePagePull::ByCudaIpc(d, stored)
                                                  : DevicePagePull::ByNccl(d, stored);
    if (s.ok()) return s;
    if (*stored) {
      return absl::Status(
          s.code(), absl::StrCat("PullPrefix: the pages pulled from peer ", peer.member_id,
                                 " over ", PullTransportName(t), " were refused: ", s.message()));
    }
    return absl::Status(
        s.code(), absl::StrCat("PullPrefix: peer ", peer.member_id, " (", peer.address, ") over ",
                               PullTransportName(t), ": ", s.message(), "; nothing was stored"));
  };

  if (status.ok() && push.num_pages() > 0) {
    const MemberInfo& self = membership_->self();
    absl::StatusOr<std::vector<PullTransport>> order = PullTransportOrder(
        config_.cluster.pull_transport, {self.member_id, config_.backend, self.node_id},
        {peer.member_id, peer.backend, peer.node_id});
    status = order.status();
    for (size_t i = 0; order.ok() && i < order->size(); ++i) {
      const PullTransport t = (*order)[i];
      bool stored = false;
      pushed.Clear();
      bytes = 0;
      status = t == PullTransport::kGrpc ? by_grpc() : by_device(t, &stored);
      if (status.ok()) {
        used = t;
        break;
      }
      // A device transport that failed before anything was stored: the next one (auto).
      if (t == PullTransport::kGrpc || stored || i + 1 == order->size()) break;
      Counts(t).fallbacks.fetch_add(1);
      KVCD_LOG(WARNING) << status.message() << "; trying " << PullTransportName((*order)[i + 1]);
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
  if (!used) return absl::OkStatus();  // nothing beyond what is held
  resp->set_pulled_tokens(pushed.inserted_tokens());
  resp->set_pulled_bytes(bytes);
  Counts(*used).pulls.fetch_add(1);
  Counts(*used).bytes.fetch_add(static_cast<uint64_t>(bytes));
  return absl::OkStatus();
}

}  // namespace kvcd
