// common/block_hash against tests/data/block_hash_vectors.json, which an independent
// implementation (tools/block_hash_vectors.py, Python's hashlib) wrote.
#include "common/block_hash.h"

#include <fstream>
#include <set>
#include <sstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvcd {
namespace block_hash_test {

nlohmann::json LoadVectors() {
  std::ifstream in(KVCD_TEST_DATA "/block_hash_vectors.json");
  EXPECT_TRUE(in.good()) << "cannot open " KVCD_TEST_DATA "/block_hash_vectors.json";
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

TEST(BlockHashTest, MatchesTheIndependentVectors) {
  const nlohmann::json doc = LoadVectors();
  ASSERT_EQ(doc.at("version").get<int>(), 1);
  const auto& vectors = doc.at("vectors");
  ASSERT_GE(vectors.size(), 8u);
  size_t hashes_checked = 0;
  for (const auto& v : vectors) {
    SCOPED_TRACE(v.at("name").get<std::string>());
    BlockNamespace ns{v.at("model").get<std::string>(), v.at("salt").get<std::string>(),
                      v.at("format").get<std::string>(), v.at("page_size").get<uint32_t>()};
    const std::vector<int32_t> tokens = v.at("tokens").get<std::vector<int32_t>>();
    const std::vector<BlockHash> got = BlockHashes(ns, tokens);
    const auto& want = v.at("hashes");
    const auto& want_ids = v.at("event_ids");
    ASSERT_EQ(got.size(), want.size());
    BlockHash parent = kRootBlockHash;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(BlockHashHex(got[i]), want[i].get<std::string>()) << "page " << i;
      EXPECT_EQ(BlockHashEventId(got[i]), want_ids[i].get<int64_t>()) << "page " << i;
      // The one-page form chains to the same value.
      const BlockHash one = ChainBlockHash(
          ns, parent, absl::MakeConstSpan(tokens).subspan(i * ns.page_size, ns.page_size));
      EXPECT_EQ(one, got[i]) << "page " << i;
      parent = got[i];
      ++hashes_checked;
    }
  }
  EXPECT_GE(hashes_checked, 20u);
}

TEST(BlockHashTest, EveryInputSeparatesBlocks) {
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  const BlockNamespace base{"m", "t", "bf16", 4};
  std::set<BlockHash> seen;
  seen.insert(BlockHashes(base, tokens)[0]);
  BlockNamespace other = base;
  other.model = "m2";
  seen.insert(BlockHashes(other, tokens)[0]);
  other = base;
  other.salt = "";
  seen.insert(BlockHashes(other, tokens)[0]);
  other = base;
  other.format = "fsq";
  seen.insert(BlockHashes(other, tokens)[0]);
  other = base;
  other.page_size = 2;
  seen.insert(BlockHashes(other, tokens)[0]);
  seen.insert(BlockHashes(base, std::vector<int32_t>{1, 2, 3, 5})[0]);
  // Length-prefixed fields: moving a byte from the model to the salt changes the hash.
  seen.insert(BlockHashes(BlockNamespace{"mt", "", "bf16", 4}, tokens)[0]);
  seen.insert(BlockHashes(BlockNamespace{"", "mt", "bf16", 4}, tokens)[0]);
  EXPECT_EQ(seen.size(), 8u);
}

TEST(BlockHashTest, OnlyFullPagesHaveANameAndTheChainDependsOnTheParent) {
  const BlockNamespace ns{"m", "", "bf16", 3};
  EXPECT_TRUE(BlockHashes(ns, std::vector<int32_t>{1, 2}).empty());
  const auto a = BlockHashes(ns, std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7});
  const auto b = BlockHashes(ns, std::vector<int32_t>{9, 9, 9, 4, 5, 6});
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_NE(a[1], b[1]);  // same page tokens, different parent
  EXPECT_TRUE(BlockHashes(BlockNamespace{"m", "", "bf16", 0}, std::vector<int32_t>{1}).empty());
}

TEST(BlockHashTest, HexRoundTripsAndBadTextIsRefused) {
  const BlockHash h = BlockHashes(BlockNamespace{"m", "", "bf16", 1}, std::vector<int32_t>{7})[0];
  const std::string hex = BlockHashHex(h);
  ASSERT_EQ(hex.size(), 64u);
  auto parsed = ParseBlockHashHex(hex);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, h);
  EXPECT_EQ(ParseBlockHashHex(hex.substr(1)).status().code(), absl::StatusCode::kInvalidArgument);
  std::string bad = hex;
  bad[10] = 'g';
  const auto status = ParseBlockHashHex(bad).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("offset 10"), std::string::npos) << status;
}

}  // namespace block_hash_test
}  // namespace kvcd
