// A client of etcd v3's own gRPC API (proto/etcd/etcd_v3.proto): the KV, Lease and Watch
// calls that cluster membership needs (docs/cluster.md "Membership"). Every call has a
// deadline; errors are absl::Status (UNAVAILABLE when no endpoint answers). With several
// endpoints a call that finds one unavailable moves on to the next for the following calls.
// What etcd returns is read as untrusted input by the callers (member_info.h).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "etcd/etcd_v3.grpc.pb.h"

namespace kvcd {

struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

// The end of the range that holds every key starting with `prefix` (etcd's prefix rule:
// the prefix with its last byte incremented).
std::string EtcdPrefixEnd(const std::string& prefix);

class EtcdClient {
 public:
  // endpoints: host:port of etcd's client port (plaintext). Never empty.
  explicit EtcdClient(std::vector<std::string> endpoints,
                      std::chrono::milliseconds call_timeout = std::chrono::milliseconds(2000));

  // Every key under `prefix` (at most `limit`; 0: no limit) and the store's revision.
  absl::StatusOr<std::vector<EtcdKeyValue>> RangePrefix(const std::string& prefix, int64_t limit,
                                                        int64_t* revision);
  absl::StatusOr<std::vector<EtcdKeyValue>> Get(const std::string& key);
  absl::Status Put(const std::string& key, const std::string& value, int64_t lease_id);
  absl::Status Delete(const std::string& key);

  // A new lease of `ttl_s`; returns its id (and the TTL etcd granted in *granted_ttl_s).
  absl::StatusOr<int64_t> LeaseGrant(int64_t ttl_s, int64_t* granted_ttl_s);
  // One keep-alive round trip: the lease's remaining TTL, 0 when the lease is gone.
  absl::StatusOr<int64_t> LeaseKeepAliveOnce(int64_t lease_id);
  absl::Status LeaseRevoke(int64_t lease_id);

  // A watch of every key under a prefix from a revision on. Next() blocks until etcd sends
  // something; Cancel() (any thread) makes it return false.
  class Watch {
   public:
    ~Watch();
    bool Next(etcdserverpb::WatchResponse* out);
    void Cancel() { ctx_.TryCancel(); }

   private:
    friend class EtcdClient;
    grpc::ClientContext ctx_;
    std::unique_ptr<
        grpc::ClientReaderWriter<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse>>
        stream_;
  };
  // UNAVAILABLE when the watch cannot be created.
  absl::StatusOr<std::unique_ptr<Watch>> WatchPrefix(const std::string& prefix,
                                                     int64_t start_revision);

  const std::vector<std::string>& endpoints() const { return endpoints_; }

 private:
  struct Stubs {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  };
  Stubs& Current();
  // Moves to the next endpoint when `s` says the current one did not answer.
  absl::Status Note(const grpc::Status& s, const char* what);
  void SetDeadline(grpc::ClientContext* ctx) const;

  std::vector<std::string> endpoints_;
  std::chrono::milliseconds call_timeout_;
  std::vector<Stubs> stubs_;
  std::atomic<size_t> current_{0};
};

}  // namespace kvcd
