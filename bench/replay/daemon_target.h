// DaemonTarget: a replay's requests served by one kvcd daemon over gRPC (the C++ client).
// K/V are synthetic and deterministic: a prompt page's rows depend only on its key, the
// appended rows only on the request and position.
#pragma once

#include <memory>
#include <string>

#include "bench/replay/target.h"
#include "client/client.h"

namespace kvcd::replay {

class DaemonTarget : public Target {
 public:
  static absl::StatusOr<std::unique_ptr<DaemonTarget>> Connect(const ClientOptions& options);

  std::string Describe() const override;
  // Registers the model (an existing one of the same geometry is used as it is); the replay
  // needs one BF16 pool (history_format BF16) and an empty cache: FAILED_PRECONDITION
  // otherwise, naming what to change.
  absl::StatusOr<int64_t> Prepare(const v1::ModelProfile& profile) override;
  absl::StatusOr<RequestOutcome> Serve(const ReplayRequest& request, bool commit,
                                       LatencyLog* log) override;
  absl::StatusOr<TargetStats> Stats() override;

 private:
  explicit DaemonTarget(std::unique_ptr<Client> c) : client_(std::move(c)) {}
  // K or V (kind 0/1) rows of `tokens` tokens starting at sequence position `first`, the page
  // at position p keyed by keys[p] (prompt pages) or, past keys, by the request: BF16
  // [layers][tokens][kv_heads][head_dim].
  void FillKv(const ReplayRequest& r, int64_t first, int64_t tokens, int kind,
              v1::TensorRef* out) const;

  std::unique_ptr<Client> client_;
  v1::ModelProfile profile_;
};

}  // namespace kvcd::replay
