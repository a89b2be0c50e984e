// NcclLinks: the daemon's NCCL communicators with workers (NcclConnect), one per
// (worker, daemon) pair of two ranks — the daemon is rank 0, the worker rank 1.
//
// Connect hands out an ncclUniqueId and joins the communicator on a background thread
// (joining blocks until the worker joins too, bounded by the link's timeout). Transfers
// of a link run one at a time, in call order, on the link's own CUDA stream, through a
// device staging buffer of the link (at most kMaxTransferBytes); every wait has the
// link's deadline, and a link whose transfer failed or timed out is aborted and answers
// FAILED_PRECONDITION until the worker connects again. Builds without CUDA (or a host
// without libnccl.so.2) answer FAILED_PRECONDITION.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "server/backends/backend.h"

namespace kvcd {

class NcclLinks {
 public:
  static constexpr uint64_t kMaxTransferBytes = uint64_t{4} << 30;
  static constexpr int kMaxLinks = 64;

  explicit NcclLinks(Backend* backend);
  ~NcclLinks();

  struct Connection {
    uint64_t id = 0;
    std::string unique_id;
  };
  absl::StatusOr<Connection> Connect(const std::string& name, int64_t timeout_ms);
  absl::Status Disconnect(uint64_t id);

  // Receives exactly `bytes` from the worker of link `id`, then calls use(device bytes)
  // (which must finish its device work before returning).
  absl::Status Receive(uint64_t id, uint64_t bytes,
                       const std::function<absl::Status(const uint8_t*)>& use);
  // Calls fill(device staging of `bytes`) (device work queued on the daemon's stream),
  // then sends the bytes to the worker of link `id`.
  absl::Status Send(uint64_t id, uint64_t bytes, const std::function<absl::Status(uint8_t*)>& fill);

  int64_t size() const;

 private:
  struct Link;
  absl::StatusOr<std::shared_ptr<Link>> Find(uint64_t id) const;

  Backend* const backend_;
  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcd
