// FaultInjector: makes a backend fail on purpose, for tests. A spec names which call fails:
//   alloc:N          the N-th AllocatePoolMemory fails (RESOURCE_EXHAUSTED)
//   copy:N           the N-th page copy (WritePages / ReadPages) fails (INTERNAL)
//   attend:N         the N-th attention launch (Attend) fails (INTERNAL)
//   sticky:KIND:N    as KIND:N, and from then on every call fails and Healthy() is false,
//                    as after an unrecoverable device error (the daemon reports NOT_SERVING
//                    and exits non-zero)
// Several comma-separated entries may be given ("alloc:2,copy:1"); N counts from 1 per
// kind. A non-sticky fault fails that one call only.
//
// WithFaultInjection wraps any backend (cpu or cuda) so that the injector is consulted
// before each of those calls and the call reaches the real backend only when it does not
// fail. Set by `kvcd serve --fault-inject SPEC` (tests only) or directly by unit tests.
//
// Thread safety: Check may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"

namespace kvcd {

class FaultInjector {
 public:
  enum class Kind { kAlloc = 0, kCopy = 1, kAttend = 2 };

  // INVALID_ARGUMENT naming the bad entry and the expected form.
  static absl::StatusOr<std::unique_ptr<FaultInjector>> Parse(const std::string& spec);

  // Counts one call of `kind`: OK, or the injected failure for this call.
  absl::Status Check(Kind kind);
  // False once a sticky fault fired.
  bool healthy() const { return !sticky_fired_.load(); }
  // Faults injected so far.
  int64_t fired() const { return fired_.load(); }

 private:
  struct Fault {
    Kind kind;
    int64_t nth;
    bool sticky;
  };
  std::vector<Fault> faults_;
  std::atomic<int64_t> calls_[3] = {};
  std::atomic<bool> sticky_fired_{false};
  std::atomic<int64_t> fired_{0};
};

// `backend` with `injector` consulted before every allocation, page copy and attention
// launch; every other call goes straight to `backend`.
std::unique_ptr<Backend> WithFaultInjection(std::unique_ptr<Backend> backend,
                                            std::shared_ptr<FaultInjector> injector);

}  // namespace kvcd
