// KvCacheService: the gRPC callback service. Reactors never block: each call's work
// runs on the request executor, which calls Finish(). The bidirectional decode stream
// handles one request at a time per stream, answering in order.
//
// With a TokenStore (auth.tokens_file) every call is authenticated from its
// `authorization: Bearer <token>` metadata and authorized (authorizer.h) before it
// reaches the engine; without one every call runs unrestricted, as before.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "common/thread_pool.h"
#include "kvcd/v1/kvcache.grpc.pb.h"
#include "server/dataplane/decode_channels.h"
#include "server/engine/cache_engine.h"
#include "server/metrics/metrics.h"
#include "server/rpc/auth.h"
#include "server/rpc/authorizer.h"

namespace kvcd {

class DecodeStreamReactor;
class ChannelAdmission;

// The generated CallbackService with every method taking raw bytes: the typed handlers
// answer a request that does not parse with UNIMPLEMENTED and an empty message (unary
// calls), or treat it exactly like the client's half-close (OnReadDone(false): the decode
// stream would end OK and drop the requests after the bad one). With the bytes in hand,
// each call parses its message itself and answers INVALID_ARGUMENT saying what did not
// parse; the stream ends with INVALID_ARGUMENT.
using KvCacheCallbackBase = v1::KvCache::WithRawCallbackMethod_RegisterModel<v1::KvCache::WithRawCallbackMethod_ListModels<
    v1::KvCache::WithRawCallbackMethod_Put<v1::KvCache::WithRawCallbackMethod_Match<
        v1::KvCache::WithRawCallbackMethod_OpenSequence<v1::KvCache::WithRawCallbackMethod_CloseSequence<
            v1::KvCache::WithRawCallbackMethod_CommitSequence<v1::KvCache::WithRawCallbackMethod_ForkSequence<
                v1::KvCache::WithRawCallbackMethod_RenewLease<v1::KvCache::WithRawCallbackMethod_Append<
                    v1::KvCache::WithRawCallbackMethod_AttentionDecode<v1::KvCache::WithRawCallbackMethod_AttentionDecodeStream<
                        v1::KvCache::WithRawCallbackMethod_FetchPages<v1::KvCache::WithRawCallbackMethod_PushPages<
                            v1::KvCache::WithRawCallbackMethod_Stats<v1::KvCache::WithRawCallbackMethod_PinPrefix<
                                v1::KvCache::WithRawCallbackMethod_UnpinPrefix<
                                    v1::KvCache::WithRawCallbackMethod_RegisterBuffer<
                                        v1::KvCache::WithRawCallbackMethod_UnregisterBuffer<
                                            v1::KvCache::WithRawCallbackMethod_RenewBuffer<
                                                v1::KvCache::WithRawCallbackMethod_NcclConnect<
                                                    v1::KvCache::WithRawCallbackMethod_NcclDisconnect<
                                                        v1::KvCache::WithRawCallbackMethod_OpenDecodeChannel<
                                                            v1::KvCache::WithRawCallbackMethod_CloseDecodeChannel<
                                                                v1::KvCache::WithRawCallbackMethod_PullPrefix<
                                                                    v1::KvCache::
                                                                        Service>>>>>>>>>>>>>>>>>>>>>>>>>;

class KvCacheService final : public KvCacheCallbackBase {
 public:
  // tokens may be null (auth off); it must outlive the service.
  KvCacheService(CacheEngine* engine, Metrics* metrics, ThreadPool* executor,
                 const TokenStore* tokens = nullptr);

  // After StartDraining, new calls get UNAVAILABLE (the server keeps accepting them, so
  // clients see UNAVAILABLE rather than a transport error); unary calls in flight finish;
  // decode streams waiting for their next request end with UNAVAILABLE (one that is
  // running a request ends after answering it); decode channels close.
  void StartDraining();
  // After StartDraining: waits until no unary call is in flight, or until `deadline`.
  // Returns true if none is left.
  bool WaitIdle(std::chrono::steady_clock::time_point deadline);
  int64_t OpenChannels() const { return channels_.size(); }

  // Unary calls: the bytes of the method's request message in, of its response out (see
  // KvCacheCallbackBase).
  grpc::ServerUnaryReactor* RegisterModel(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* req,
                                          grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* req,
                                       grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Put(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Match(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                  grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* OpenSequence(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* req,
                                         grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* CloseSequence(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* req,
                                          grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* CommitSequence(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* req,
                                           grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* req,
                                         grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* RenewLease(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* req,
                                       grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Append(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                   grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* AttentionDecode(grpc::CallbackServerContext* ctx,
                                            const grpc::ByteBuffer* req,
                                            grpc::ByteBuffer* resp) override;
  // AttentionDecodeRequest messages in, AttentionDecodeStreamResponse messages out.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionDecodeStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* FetchPages(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* req,
                                       grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* PushPages(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  // Cluster: runs the pull handler (set_pull_handler) with the caller's authorization
  // metadata; without one, FAILED_PRECONDITION (no cluster).
  grpc::ServerUnaryReactor* PullPrefix(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* req,
                                       grpc::ByteBuffer* resp) override;
  using PullHandler =
      std::function<absl::Status(const v1::PullPrefixRequest& req, const std::string& authorization,
                                 v1::PullPrefixResponse* resp)>;
  // REQUIRES: called before the service serves.
  void set_pull_handler(PullHandler handler) { pull_ = std::move(handler); }
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                  grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* PinPrefix(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* UnpinPrefix(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* RegisterBuffer(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* req,
                                           grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* UnregisterBuffer(grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* req,
                                             grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* RenewBuffer(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* NcclConnect(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* NcclDisconnect(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* req,
                                           grpc::ByteBuffer* resp) override;

  grpc::ServerUnaryReactor* OpenDecodeChannel(grpc::CallbackServerContext* ctx,
                                              const grpc::ByteBuffer* req,
                                              grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* CloseDecodeChannel(grpc::CallbackServerContext* ctx,
                                               const grpc::ByteBuffer* req,
                                               grpc::ByteBuffer* resp) override;

  // Runs one decode request as the stream does (also used by the unary call), on the
  // sequences its authorization found.
  absl::Status Decode(const v1::AttentionDecodeRequest& req, v1::AttentionDecodeResponse* resp,
                      const FoundSequences& found);

 private:
  // One unary call, run on the executor: parses a Req from `in` (INVALID_ARGUMENT saying
  // so when it does not parse), then fn(principal, req, &resp), then writes resp to `out`.
  template <class Req, class Resp, class Fn>
  grpc::ServerUnaryReactor* Run(const char* method, grpc::CallbackServerContext* ctx,
                                const grpc::ByteBuffer* in, grpc::ByteBuffer* out, Fn fn);
  void CallDone();  // a call or stream request finished (in_flight_ - 1; wakes WaitIdle)
  // The principal of a call: Principal::Unrestricted() without auth, else from the
  // call's bearer token (UNAUTHENTICATED if missing or unknown).
  absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(
      grpc::CallbackServerContext* ctx) const;
  // The same for a saved `authorization` value (nullopt: none was sent). Long-lived
  // streams and decode channels re-resolve it for every request, so a token revoked by a
  // reload stops working on them too.
  absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(
      const std::optional<std::string>& authorization) const;
  static std::optional<std::string> AuthorizationOf(grpc::CallbackServerContext* ctx);

  CacheEngine* engine_;
  PullHandler pull_;  // null: this daemon is in no cluster
  Metrics* metrics_;
  ThreadPool* executor_;
  const TokenStore* tokens_;
  Authorizer authz_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> in_flight_{0};  // unary calls and stream requests being handled
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::mutex streams_mu_;
  std::set<DecodeStreamReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
  // The DecodeChannel/OK latency histogram, looked up on the first successful request.
  std::atomic<prometheus::Histogram*> channel_ok_seconds_{nullptr};
  DecodeChannels channels_;
  friend class DecodeStreamReactor;
  friend class ChannelAdmission;
};

}  // namespace kvcd
