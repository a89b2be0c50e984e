#include "server/cluster/member_info.h"

#include <cctype>
#include <fstream>
#include <regex>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/random_id.h"
#include "nlohmann/json.hpp"

namespace kvcd {
namespace {

using json = nlohmann::json;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("member value: ", what));
}

// Reads a string field of at most `max` bytes.
absl::Status ReadString(const json& j, const char* key, size_t max, bool required,
                        std::string* out) {
  const auto it = j.find(key);
  if (it == j.end()) {
    return required ? Bad(absl::StrCat("field '", key, "' is missing")) : absl::OkStatus();
  }
  if (!it->is_string()) return Bad(absl::StrCat("field '", key, "' is not a string"));
  const auto& s = it->get_ref<const std::string&>();
  if (s.size() > max) {
    return Bad(absl::StrCat("field '", key, "' has ", s.size(), " bytes, at most ", max));
  }
  *out = s;
  return absl::OkStatus();
}

template <class T>
absl::Status ReadNumber(const json& j, const char* key, T* out) {
  const auto it = j.find(key);
  if (it == j.end()) return Bad(absl::StrCat("field '", key, "' is missing"));
  if (!it->is_number_integer()) return Bad(absl::StrCat("field '", key, "' is not an integer"));
  if (std::is_unsigned_v<T> && !it->is_number_unsigned()) {
    return Bad(absl::StrCat("field '", key, "' is negative"));
  }
  *out = it->get<T>();
  return absl::OkStatus();
}

}  // namespace

std::string NewIncarnation() {
  static constexpr char kDigits[] = "0123456789abcdef";
  const uint64_t id = RandomId64();
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[i] = kDigits[(id >> (60 - 4 * i)) & 0xf];
  return s;
}

bool IsValidMemberId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (const char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

std::string LocalNodeId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!std::getline(f, id)) return std::string();
  static const std::regex kNodeId("[0-9A-Za-z-]{1,64}");
  return std::regex_match(id, kNodeId) ? id : std::string();
}

std::string EncodeMemberInfo(const MemberInfo& m) {
  json j = {{"member_id", m.member_id},
            {"address", m.address},
            {"backend", m.backend},
            {"capacity_pages", m.capacity_pages},
            {"page_bytes", m.page_bytes},
            {"incarnation", m.incarnation},
            {"started_unix_ms", m.started_unix_ms},
            {"version", m.version},
            {"events_endpoint", m.events_endpoint}};
  if (!m.node_id.empty()) j["node_id"] = m.node_id;
  return j.dump();
}

absl::StatusOr<MemberInfo> DecodeMemberInfo(absl::string_view value,
                                            absl::string_view key_member_id) {
  if (value.size() > kMaxMemberValueBytes) {
    return Bad(absl::StrCat(value.size(), " bytes, at most ", kMaxMemberValueBytes));
  }
  const json j = json::parse(value.begin(), value.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("not JSON");
  if (!j.is_object()) return Bad("not a JSON object");
  MemberInfo m;
  if (absl::Status s = ReadString(j, "member_id", 128, true, &m.member_id); !s.ok()) return s;
  if (m.member_id != key_member_id) {
    return Bad(
        absl::StrCat("member_id '", m.member_id, "' differs from the key's '", key_member_id, "'"));
  }
  if (!IsValidMemberId(m.member_id)) return Bad("member_id has characters other than A-Za-z0-9._-");
  if (absl::Status s = ReadString(j, "address", 261, true, &m.address); !s.ok()) return s;
  static const std::regex kAddress("([A-Za-z0-9._-]{1,253}|\\[[0-9A-Fa-f:.]{2,45}\\]):[0-9]{1,5}");
  if (!std::regex_match(m.address, kAddress)) {
    return Bad(absl::StrCat("address '", m.address, "' is not host:port"));
  }
  if (absl::Status s = ReadString(j, "backend", 16, true, &m.backend); !s.ok()) return s;
  if (m.backend != "cpu" && m.backend != "cuda") {
    return Bad(absl::StrCat("backend '", m.backend, "' is not cpu or cuda"));
  }
  if (absl::Status s = ReadNumber(j, "capacity_pages", &m.capacity_pages); !s.ok()) return s;
  if (absl::Status s = ReadNumber(j, "page_bytes", &m.page_bytes); !s.ok()) return s;
  if (absl::Status s = ReadString(j, "incarnation", 16, true, &m.incarnation); !s.ok()) return s;
  static const std::regex kIncarnation("[0-9a-f]{16}");
  if (!std::regex_match(m.incarnation, kIncarnation)) {
    return Bad("incarnation is not 16 lowercase hex characters");
  }
  if (absl::Status s = ReadNumber(j, "started_unix_ms", &m.started_unix_ms); !s.ok()) return s;
  if (absl::Status s = ReadString(j, "version", 64, false, &m.version); !s.ok()) return s;
  if (absl::Status s = ReadString(j, "events_endpoint", 270, false, &m.events_endpoint); !s.ok()) {
    return s;
  }
  if (!m.events_endpoint.empty() && m.events_endpoint.rfind("tcp://", 0) != 0) {
    return Bad("events_endpoint is neither empty nor tcp://host:port");
  }
  if (absl::Status s = ReadString(j, "node_id", 64, false, &m.node_id); !s.ok()) return s;
  static const std::regex kNodeId("[0-9A-Za-z-]*");
  if (!std::regex_match(m.node_id, kNodeId))
    return Bad("node_id has characters other than 0-9A-Za-z-");
  return m;
}

}  // namespace kvcd
