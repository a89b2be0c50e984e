// The member value read back from etcd is hostile: everything is bounded and checked.
#include "server/cluster/member_info.h"

#include <gtest/gtest.h>

#include <regex>
#include <set>

namespace kvcd {
namespace member_info_test {

MemberInfo Sample() {
  MemberInfo m;
  m.member_id = "kvcd-0";
  m.address = "10.0.0.7:50051";
  m.backend = "cpu";
  m.capacity_pages = 1024;
  m.page_bytes = 65536;
  m.incarnation = NewIncarnation();
  m.started_unix_ms = 1764900000000;
  m.version = "0.1.0";
  m.events_endpoint = "tcp://10.0.0.7:5557";
  m.node_id = "0f6d2a4e-3c51-4b7e-9a0d-2b1c8e4f5a61";
  return m;
}

TEST(MemberInfoTest, RoundTrips) {
  const MemberInfo m = Sample();
  auto back = DecodeMemberInfo(EncodeMemberInfo(m), "kvcd-0");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->member_id, m.member_id);
  EXPECT_EQ(back->address, m.address);
  EXPECT_EQ(back->backend, m.backend);
  EXPECT_EQ(back->capacity_pages, m.capacity_pages);
  EXPECT_EQ(back->page_bytes, m.page_bytes);
  EXPECT_EQ(back->incarnation, m.incarnation);
  EXPECT_EQ(back->started_unix_ms, m.started_unix_ms);
  EXPECT_EQ(back->version, m.version);
  EXPECT_EQ(back->events_endpoint, m.events_endpoint);
  EXPECT_EQ(back->node_id, m.node_id);
  // node_id is optional: a value without it (an older member) decodes with it empty.
  MemberInfo old = m;
  old.node_id.clear();
  EXPECT_EQ(EncodeMemberInfo(old).find("node_id"), std::string::npos);
  back = DecodeMemberInfo(EncodeMemberInfo(old), "kvcd-0");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->node_id, "");
}

TEST(MemberInfoTest, LocalNodeIdIsTheBootId) {
  const std::string id = LocalNodeId();
  // Linux hosts have one; it is what another member on this node advertises too.
  EXPECT_TRUE(std::regex_match(id, std::regex("[0-9a-f-]{36}"))) << id;
  EXPECT_EQ(LocalNodeId(), id);
}

TEST(MemberInfoTest, IncarnationsAreSixteenHexAndFresh) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const std::string s = NewIncarnation();
    EXPECT_TRUE(std::regex_match(s, std::regex("[0-9a-f]{16}"))) << s;
    seen.insert(s);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(MemberInfoTest, HostileValuesAreRefused) {
  const std::string good = EncodeMemberInfo(Sample());
  auto with = [&](const std::string& key, const std::string& json_value) {
    std::string v = good;
    const std::string needle = "\"" + key + "\":";
    const auto p = v.find(needle);
    EXPECT_NE(p, std::string::npos) << key;
    const auto b = p + needle.size();
    auto e = v.find_first_of(",}", v[b] == '"' ? v.find('"', b + 1) : b);
    return v.substr(0, b) + json_value + v.substr(e);
  };
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "not JSON"},
      {"[1,2]", "not a JSON object"},
      {std::string(5000, ' '), "at most 4096"},
      {with("member_id", "\"kvcd-1\""), "differs from the key"},
      {with("address", "\"10.0.0.7\""), "is not host:port"},
      {with("address", "\"a b:1\""), "is not host:port"},
      {with("address", "7"), "is not a string"},
      {with("backend", "\"tpu\""), "is not cpu or cuda"},
      {with("capacity_pages", "-1"), "is negative"},
      {with("capacity_pages", "\"12\""), "is not an integer"},
      {with("incarnation", "\"XYZ\""), "16 lowercase hex"},
      {with("events_endpoint", "\"ipc:///x\""), "events_endpoint"},
      {with("version", "\"" + std::string(100, 'v') + "\""), "at most 64"},
      {with("node_id", "\"a/b\""), "node_id"},
      {with("node_id", "\"" + std::string(65, 'f') + "\""), "at most 64"},
      {with("node_id", "5"), "is not a string"},
  };
  for (const auto& [value, want] : bad) {
    auto r = DecodeMemberInfo(value, "kvcd-0");
    ASSERT_FALSE(r.ok()) << value;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(want), std::string::npos)
        << value << " -> " << r.status().message();
  }
  EXPECT_FALSE(IsValidMemberId(""));
  EXPECT_FALSE(IsValidMemberId("a:b"));
  EXPECT_FALSE(IsValidMemberId(std::string(129, 'a')));
  EXPECT_TRUE(IsValidMemberId("kvcd-0.pod_1"));
}

}  // namespace member_info_test
}  // namespace kvcd
