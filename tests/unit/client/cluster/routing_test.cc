// The cluster client's routing (client/cluster/routing.h) on the cases the Python client's
// tests use too (client/python/tests/test_cluster_routing.py).
#include "client/cluster/routing.h"

#include <gtest/gtest.h>
#include <openssl/sha.h>

#include <algorithm>
#include <string>
#include <vector>

namespace kvcd::cluster {
namespace routing_test {

std::string H(int i) { return std::string(32, static_cast<char>(i)); }

std::string Sha(const std::string& s) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d);
  return std::string(reinterpret_cast<char*>(d), sizeof(d));
}

TEST(Routing, ConsecutivePrefixesCountFromPageZeroWithoutGaps) {
  std::vector<PageHolders> holders = {
      {{"a", "host"}, {"b", "host"}}, {{"a", "host"}}, {{"b", "host"}, {"a", "host"}}, {}};
  auto runs = ConsecutivePrefixes(holders);
  EXPECT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs["a"], 3);
  EXPECT_EQ(runs["b"], 1);
  EXPECT_TRUE(ConsecutivePrefixes(std::vector<PageHolders>{{}, {{"a", "host"}}}).empty());
  EXPECT_TRUE(ConsecutivePrefixes({}).empty());
}

TEST(Routing, LoadValueAndScoreFollowTheContract) {
  Load l{50, 100, 2, 1, 0};
  EXPECT_DOUBLE_EQ(LoadValue(&l, 16, 4, std::nullopt), 32 + 48);  // beta = one page
  EXPECT_DOUBLE_EQ(LoadValue(&l, 16, 4, 2.0), 32 + 6);
  EXPECT_DOUBLE_EQ(LoadValue(nullptr, 16, 4, std::nullopt), 0.0);
  Load no_capacity{5, 0, 0, 0, 0};
  EXPECT_DOUBLE_EQ(LoadValue(&no_capacity, 16, 4, std::nullopt), 0.0);
  Load over{500, 100, 0, 0, 0};  // utilization is capped at 1
  EXPECT_DOUBLE_EQ(LoadValue(&over, 16, 4, std::nullopt), 64);
  EXPECT_DOUBLE_EQ(Score(4, 16, 10, 0.5), 64 - 5);
}

TEST(Routing, IndexHitsWinUntilLoadOutweighsThem) {
  std::vector<std::string> hashes = {H(0), H(1), H(2), H(3)};
  std::vector<PageHolders> holders(4, PageHolders{{"a", "host"}});
  RoutingConfig cfg;
  cfg.replicate_after = 0;
  std::vector<std::string> members = {"a", "b"};
  absl::flat_hash_map<std::string, Load> idle = {{"a", {50, 100}}, {"b", {0, 100}}};
  Decision d = Decide(hashes, holders, members, idle, 16, cfg, nullptr);
  EXPECT_EQ(d.member_id, "a");
  EXPECT_EQ(d.hit_pages, 4);
  EXPECT_EQ(d.reason, "index");
  absl::flat_hash_map<std::string, Load> busy = {{"a", {50, 100, 10}}, {"b", {0, 100}}};
  d = Decide(hashes, holders, members, busy, 16, cfg, nullptr);
  EXPECT_EQ(d.member_id, "b");  // a is above the bounded-load cap
  EXPECT_EQ(d.reason, "rendezvous");
}

TEST(Routing, ExcludedAndUnknownHoldersAreNotChosen) {
  std::vector<std::string> hashes = {H(1)};
  std::vector<PageHolders> holders = {{{"a", "host"}, {"ghost", "host"}}};
  std::vector<std::string> members = {"a", "b"};
  std::vector<std::string> exclude = {"a"};
  Decision d = Decide(hashes, holders, members, {}, 16, RoutingConfig(), nullptr, exclude);
  EXPECT_EQ(d.member_id, "b");
  EXPECT_EQ(d.reason, "rendezvous");
  std::vector<std::string> only_a = {"a"};
  EXPECT_TRUE(
      Decide(hashes, holders, only_a, {}, 16, RoutingConfig(), nullptr, exclude).member_id.empty());
}

TEST(Routing, RendezvousWeightIsTheContractHash) {
  const std::string h = H(9);
  const std::string d = Sha(std::string("m0") + '\0' + h);
  uint64_t want = 0;
  for (int i = 0; i < 8; ++i) want = (want << 8) | static_cast<unsigned char>(d[i]);
  EXPECT_EQ(RendezvousWeight("m0", h), want);
}

TEST(Routing, RendezvousMovesOnlyTheKeysOfARemovedMember) {
  std::vector<std::string> four = {"m0", "m1", "m2", "m3"};
  std::vector<std::string> three = {"m0", "m1", "m2"};
  absl::flat_hash_map<std::string, int> counts;
  int moved = 0;
  for (int i = 0; i < 2000; ++i) {
    const std::string key = Sha(std::to_string(i));
    const std::string before = Rendezvous(key, four);
    const std::string after = Rendezvous(key, three);
    ++counts[before];
    if (before != after) {
      ++moved;
      EXPECT_EQ(before, "m3");
    }
  }
  EXPECT_GT(moved, 0);
  for (const auto& m : four) EXPECT_GT(counts[m], 400) << m;
}

TEST(Routing, BoundedLoadKeepsEveryMemberUnderTheCap) {
  absl::flat_hash_map<std::string, double> load = {{"m0", 0}, {"m1", 0}, {"m2", 0}, {"m3", 0}};
  for (int i = 0; i < 4000; ++i) {
    const std::string key = Sha(std::to_string(i % 7));  // 7 distinct keys only
    load[Rendezvous(key, BoundedMembers(load, 1.25))] += 1;
  }
  double max = 0;
  for (const auto& [m, v] : load) max = std::max(max, v);
  EXPECT_LE(max, 1.25 * 1000 + 1);
  absl::flat_hash_map<std::string, double> zero = {{"a", 0}, {"b", 0}};
  EXPECT_EQ(BoundedMembers(zero, 1.25), (std::vector<std::string>{"a", "b"}));
  absl::flat_hash_map<std::string, double> skew = {{"a", 10}, {"b", 0}};
  EXPECT_EQ(BoundedMembers(skew, 1.25), (std::vector<std::string>{"b"}));
  EXPECT_TRUE(BoundedMembers({}, 1.25).empty());
}

TEST(Routing, HotPrefixIsReplicatedToTheRendezvousSecond) {
  double now = 0;
  RoutingConfig cfg;
  cfg.replicate_after = 3;
  cfg.window_s = 10;
  HotPrefixes hot(cfg.window_s, cfg.max_tracked_prefixes, [&] { return now; });
  std::vector<std::string> hashes;
  for (int i = 0; i < 8; ++i) hashes.push_back(H(i));
  std::vector<PageHolders> holders(8, PageHolders{{"a", "host"}});
  std::vector<std::string> members = {"a", "b", "c"};
  absl::flat_hash_map<std::string, Load> loads = {
      {"a", {90, 100, 1}}, {"b", {10, 100}}, {"c", {10, 100}}};
  std::vector<std::string> reasons;
  Decision last;
  for (int i = 0; i < 4; ++i) {
    last = Decide(hashes, holders, members, loads, 16, cfg, &hot);
    reasons.push_back(last.reason);
  }
  EXPECT_EQ(reasons, (std::vector<std::string>{"index", "index", "index", "replicate"}));
  EXPECT_EQ(last.pull_from, "a");
  std::vector<std::string> bc = {"b", "c"};
  EXPECT_EQ(last.member_id, Rendezvous(hashes[0], bc));
  EXPECT_EQ(Decide(hashes, holders, members, loads, 16, cfg, &hot).reason, "index");
  for (int i = 0; i < 3; ++i) Decide(hashes, holders, members, loads, 16, cfg, &hot);
  now = 100;  // the window passed
  EXPECT_EQ(Decide(hashes, holders, members, loads, 16, cfg, &hot).reason, "index");
  // A holder at or below the mean load is not relieved.
  absl::flat_hash_map<std::string, Load> even = {
      {"a", {10, 100}}, {"b", {10, 100}}, {"c", {10, 100}}};
  HotPrefixes hot2(cfg.window_s, cfg.max_tracked_prefixes, [&] { return now; });
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(Decide(hashes, holders, members, even, 16, cfg, &hot2).reason, "index");
  }
}

TEST(Routing, HotPrefixTrackingIsBounded) {
  HotPrefixes hot(10, 10);
  for (int i = 0; i < 100; ++i) hot.Record(H(i), "a");
  EXPECT_EQ(hot.tracked(), 10u);
  EXPECT_EQ(hot.Record(H(99), "a"), 2);  // the most recent pairs are kept
  EXPECT_EQ(hot.Record(H(0), "a"), 1);   // the oldest was forgotten
}

}  // namespace routing_test
}  // namespace kvcd::cluster
