// A cluster member as etcd holds it (docs/cluster.md "Membership"): the JSON value of
// <prefix>/members/<member_id>. Decoding treats the value as hostile (a compromised or
// buggy peer, a hand-edited key): sizes are bounded, every field is type-checked, and the
// member id must match the key's.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcd {

struct MemberInfo {
  std::string member_id;
  std::string address;  // host:port of the gRPC API
  std::string backend;  // cpu | cuda
  uint64_t capacity_pages = 0;
  uint64_t page_bytes = 0;
  std::string incarnation;  // 16 lowercase hex characters, new at every start
  int64_t started_unix_ms = 0;
  std::string version;
  std::string events_endpoint;  // tcp://host:port or empty
  // The machine's identity (its kernel's boot id) or empty: two CUDA members with the same
  // node id may move pages by CUDA IPC (docs/cluster.md "Transports").
  std::string node_id;
};

// This machine's node id: /proc/sys/kernel/random/boot_id, or empty when unreadable.
std::string LocalNodeId();

// The largest member value accepted from etcd.
inline constexpr size_t kMaxMemberValueBytes = 4096;

// 16 random lowercase hex characters (the kernel's random source).
std::string NewIncarnation();
// Letters, digits, '.', '_', '-'; 1..128 characters (the same rule as cluster.member_id).
bool IsValidMemberId(absl::string_view id);

std::string EncodeMemberInfo(const MemberInfo& m);
// INVALID_ARGUMENT naming what was wrong: not JSON, too large, a missing or mistyped field,
// a member id that differs from `key_member_id`, an address that is not host:port, an
// incarnation that is not 16 hex characters.
absl::StatusOr<MemberInfo> DecodeMemberInfo(absl::string_view value,
                                            absl::string_view key_member_id);

}  // namespace kvcd
