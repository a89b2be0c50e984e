// SequenceTable: the one owner of the daemon's open sequences — ids (random 64-bit values,
// unguessable and not reused across restarts), leases, the max_sequences bound — and the
// lease policy every leased object (sequences, CUDA IPC buffers, decode channels) is
// granted by.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/steady_clock.h"
#include "server/cache/model_cache.h"
#include "server/cache/sequence.h"

namespace kvcd {

struct LeasePolicy {
  int64_t default_ms = 30000;
  int64_t max_ms = 600000;
  // The lease for a request: 0 = the default; INVALID_ARGUMENT outside 10..max_ms.
  absl::StatusOr<int64_t> Grant(int64_t requested_ms) const;
};

class SequenceTable {
 public:
  SequenceTable(LeasePolicy leases, int64_t max_sequences)
      : leases_(leases), max_sequences_(max_sequences) {}
  // Closes every sequence still open.
  ~SequenceTable();

  const LeasePolicy& leases() const { return leases_; }

  // Opens a sequence of `model` on the cached prefix of `tokens` with a lease of lease_ms
  // (already granted). RESOURCE_EXHAUSTED at max_sequences.
  absl::StatusOr<std::shared_ptr<Sequence>> Open(ModelCache* model, const std::string& salt,
                                                 absl::Span<const int32_t> tokens,
                                                 int64_t lease_ms);
  // NOT_FOUND unless open; refreshes the lease of a found sequence.
  absl::StatusOr<std::shared_ptr<Sequence>> Find(uint64_t id);
  // The tenant (cache_salt) of an open sequence, without touching its lease; NOT_FOUND with
  // Find's message otherwise.
  absl::StatusOr<std::string> Salt(uint64_t id) const;
  // Removes and closes it; its length before closing.
  absl::StatusOr<int64_t> Close(uint64_t id);
  // Sets a new lease (0 keeps the current one) and refreshes it; the lease in force.
  absl::StatusOr<int64_t> Renew(uint64_t id, int64_t lease_ms);
  // Closes the sequences whose lease ran out before now_ns; how many.
  int Expire(int64_t now_ns);
  int64_t size() const;

 private:
  absl::StatusOr<std::shared_ptr<Sequence>> Get(uint64_t id) const;
  static void Touch(Sequence* seq);

  const LeasePolicy leases_;
  const int64_t max_sequences_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcd
