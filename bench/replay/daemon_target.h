// DaemonTarget: a replay's requests served by one kvcd daemon over gRPC (the C++ client).
// K/V are synthetic and deterministic: a full page's rows depend only on its key (the prompt's
// blocks, then the keys of the pages a commit inserts) and their positions, so every full page
// has the same rows whichever request stored it; the last, partial page's rows depend on the
// request. With verify_every N, every N-th request's attention over its whole sequence is
// compared with a float64 reference computed from those rows (reference_attention.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

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

  // Check every n-th request (by trace index; 0 = none): AttentionDecode over every layer of
  // the open sequence against the reference. A mismatch is counted in the outcome
  // (RequestOutcome::wrong), never an error.
  void set_verify_every(int64_t n) { verify_every_ = n; }

 private:
  explicit DaemonTarget(std::unique_ptr<Client> c) : client_(std::move(c)) {}
  // K or V (kind 0/1) rows of `tokens` tokens starting at sequence position `first`, the page
  // at position p keyed by keys[p] (prompt pages) or, past keys, by the request: BF16
  // [layers][tokens][kv_heads][head_dim].
  void FillKv(const ReplayRequest& r, int64_t first, int64_t tokens, int kind,
              v1::TensorRef* out) const;
  std::vector<uint16_t> Rows(const ReplayRequest& r, int64_t first, int64_t tokens, int kind) const;
  // Attention of the open sequence (seq_len tokens) on every layer against the reference:
  // OK with *wrong set, or the call's error.
  absl::Status Verify(const ReplayRequest& r, uint64_t sequence_id, int64_t seq_len, bool* wrong,
                      std::string* detail);

  std::unique_ptr<Client> client_;
  v1::ModelProfile profile_;
  int64_t verify_every_ = 0;
};

}  // namespace kvcd::replay
