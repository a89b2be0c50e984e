// The CacheEngine tests' fixture, shared by the tests of the engine's parts
// (cache_engine_test.cc, model_registration_test.cc): an engine on the CPU backend with the
// tiny model registered, and what the tests read of it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "server/engine/cache_engine.h"
#include "test_util.h"

namespace kvcd::engine_test {

class CacheEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::make_unique<CacheEngine>(testing_util::TestConfig(), MakeCpuBackend(2));
    ASSERT_TRUE(engine_->RegisterModelSpec(spec_).ok());
  }

  uint64_t Open(uint64_t seed, int64_t n, int64_t* matched = nullptr,
                const std::string& salt = "") {
    v1::OpenSequenceRequest req;
    req.set_model(spec_.name);
    req.set_cache_salt(salt);
    const auto t = synthetic::Tokens(seed, 0, n);
    req.mutable_tokens()->Add(t.begin(), t.end());
    v1::OpenSequenceResponse resp;
    EXPECT_TRUE(engine_->OpenSequence(req, &resp).ok());
    if (matched) *matched = resp.matched_tokens();
    return resp.sequence_id();
  }

  // Everything observable about stored content: pool usage, cached tokens, and the
  // exact bytes a fetch of `seq` returns.
  std::string Fingerprint(uint64_t seq) {
    v1::StatsResponse stats;
    EXPECT_TRUE(engine_->Stats(v1::StatsRequest(), &stats).ok());
    std::string fp;
    for (const auto& m : stats.models()) {
      fp += m.profile().name() + ":" + std::to_string(m.cached_tokens());
      for (const auto& p : m.pools()) fp += "/" + std::to_string(p.pages_used());
    }
    fp += "|pins " + std::to_string(stats.pins_size());
    v1::FetchPagesRequest f;
    f.set_sequence_id(seq);
    f.set_expand_to_bf16(true);
    f.set_expand_to_bf16(true);
    v1::FetchPagesResponse fr;
    EXPECT_TRUE(engine_->FetchPages(f, &fr).ok());
    fp += "|" + std::to_string(fr.num_tokens()) + "|" + fr.k().inline_data() + fr.v().inline_data();
    return fp;
  }

  ModelSpec spec_ = testing_util::TinySpec();
  std::unique_ptr<CacheEngine> engine_;
};

}  // namespace kvcd::engine_test
