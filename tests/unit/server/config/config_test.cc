#include "server/config/config.h"

#include <gtest/gtest.h>

namespace kvcd {
namespace {

TEST(ConfigTest, DefaultsAndBuiltinModels) {
  auto c = ParseConfig(R"(
listen: 127.0.0.1:6000
memory_budget: 2GiB
models:
  - builtin: qwen3-8b
    memory: 1GiB
  - builtin: tiny
    name: tiny-int
    recent_tokens: 16
)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "127.0.0.1:6000");
  EXPECT_EQ(c->metrics_listen, "127.0.0.1:9464");
  EXPECT_EQ(c->memory_budget_bytes, 2ull << 30);
  ASSERT_EQ(c->models.size(), 2u);
  EXPECT_EQ(c->models[0].num_layers, 36);
  EXPECT_EQ(c->models[0].num_q_heads, 32);
  EXPECT_EQ(c->models[0].num_kv_heads, 8);
  EXPECT_EQ(c->models[0].head_dim, 128);
  EXPECT_EQ(c->models[0].page_size, 64);
  EXPECT_EQ(c->models[0].sink_tokens, 64);
  EXPECT_EQ(c->models[0].recent_tokens, 256);
  EXPECT_EQ(c->models[1].name, "tiny-int");
  EXPECT_EQ(c->models[1].recent_tokens, 16);
  EXPECT_TRUE(ParseConfig("").ok());  // empty file: all defaults
}

TEST(ConfigTest, EveryBadFieldIsNamed) {
  struct Case {
    const char* yaml;
    const char* needle;
  };
  const Case cases[] = {
      {"listn: x", "unknown key 'listn'"},
      {"memory_budget: 12XB", "unit 'XB'"},
      {"memory_budget: lots", "not a size"},
      {"backend: tpu", "backend is 'tpu'"},
      {"high_watermark: 0.5\nlow_watermark: 0.6", "watermarks"},
      {"lease: {default_ms: 5}", "lease.default_ms"},
      {"max_message_bytes: 10", "max_message_bytes"},
      {"worker_threads: -1", "worker_threads"},
      {"models: {a: 1}", "models must be a list"},
      {"models: [{builtin: llama}]", "builtin is 'llama'"},
      {"models: [{builtin: tiny, head_dim: 48}]", "head_dim is 48"},
      {"models: [{builtin: tiny, page_size: 0}]", "page_size is 0"},
      {"models: [{builtin: tiny, sink_tokens: 6}]", "sink_tokens is 6"},
      {"models: [{builtin: tiny, num_q_heads: 3}]", "num_q_heads is 3"},
      {"models: [{builtin: tiny, history_format: int4}]", "history_format is 'int4'"},
      {"models: [{builtin: tiny, name: 'a b'}]", "name may contain only"},
      {"models: [{builtin: tiny, rope: {theta: -1}}]", "rope.theta"},
      {"models: [{builtin: tiny, colour: red}]", "unknown key 'models[0].colour'"},
      {"models: [{builtin: tiny, num_layers: many}]", "num_layers"},
      {"models: [{builtin: tiny}, {builtin: tiny}]", "appears twice"},
      {"memory_budget: 1MiB\nmodels: [{builtin: tiny, memory: 2MiB}]", "more than memory_budget"},
      {"listen: [1, 2", "not valid YAML"},
  };
  for (const auto& c : cases) {
    auto r = ParseConfig(c.yaml);
    ASSERT_FALSE(r.ok()) << c.yaml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos)
        << c.yaml << " -> " << r.status().message();
  }
}

TEST(ConfigTest, ByteSizes) {
  EXPECT_EQ(*ParseByteSize("1024"), 1024u);
  EXPECT_EQ(*ParseByteSize("1KiB"), 1024u);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*ParseByteSize("2 MB"), 2000000u);
  EXPECT_FALSE(ParseByteSize("-1").ok());
  EXPECT_FALSE(ParseByteSize("1e30").ok());
}

}  // namespace
}  // namespace kvcd
