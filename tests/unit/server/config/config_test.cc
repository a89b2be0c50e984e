#include "server/config/config.h"

#include <gtest/gtest.h>

#include <fstream>

#include "common/fsq_codec.h"

namespace kvcd {
namespace config_test {

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
      {"memory_budget: 12XB", "memory_budget is '12XB', expected a size in bytes"},
      {"memory_budget: lots", "memory_budget is 'lots'"},
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
      {"models: [{builtin: tiny, history_format: fsq, fsq_latent_width: 8}]",
       "fsq_residual_width is 0, expected 1..65536"},
      {"models: [{builtin: tiny, history_format: fsq, fsq_residual_width: 64}]",
       "fsq_latent_width is 0, expected 1..4096"},
      {"models: [{builtin: tiny, history_format: fsq, fsq_residual_width: 64, "
       "fsq_latent_width: 5000}]",
       "fsq_latent_width is 5000"},
      {"models: [{builtin: tiny, history_format: fsq, fsq_residual_width: 64, "
       "fsq_latent_width: 8, codec: hadamard}]",
       "expected empty for history_format fsq"},
      {"models: [{builtin: tiny, history_format: fsq, fsq_residual_width: 64, "
       "fsq_latent_width: 8, key_norm: rms, key_norm_eps: 0}]",
       "key_norm_eps is 0"},
      {"models: [{builtin: tiny, key_norm: layer}]", "key_norm is 'layer'"},
      {"models: [{builtin: tiny, fsq_latent_width: 8}]", "only used with history_format fsq"},
      {"models: [{builtin: tiny, rope: {pairing: zigzag}}]", "rope.pairing is 'zigzag'"},
      {"models: [{builtin: tiny, rope: {rotary_dims: 7}}]", "rope.rotary_dims is 7"},
  };
  for (const auto& c : cases) {
    auto r = ParseConfig(c.yaml);
    ASSERT_FALSE(r.ok()) << c.yaml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos)
        << c.yaml << " -> " << r.status().message();
  }
}

TEST(ConfigTest, TenantQuotas) {
  auto c = ParseConfig(R"(
quotas:
  default: {max_sequences: 8, max_memory_share: 0.5, max_models: 2, max_model_bytes: 64MiB}
  tenants:
    - {tenant: team-a, max_memory_share: 0.25, max_pinned_prefix_pages: 12, max_decode_channels: 3}
    - {tenant: "", max_pinned_pages: 100, max_lease_ms: 5000, max_memory_share: 1}
)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->quotas.defaults.max_sequences, 8);
  EXPECT_DOUBLE_EQ(c->quotas.defaults.max_memory_share, 0.5);
  EXPECT_EQ(c->quotas.defaults.max_models, 2);
  EXPECT_EQ(c->quotas.defaults.max_model_bytes, 64ull << 20);
  const TenantQuota& a = c->quotas.For("team-a");
  EXPECT_DOUBLE_EQ(a.max_memory_share, 0.25);
  EXPECT_EQ(a.max_sequences, 8);  // keys not given: the defaults
  EXPECT_EQ(a.max_models, 2);
  EXPECT_EQ(a.max_model_bytes, 64ull << 20);
  EXPECT_EQ(a.max_pinned_prefix_pages, 12);
  EXPECT_EQ(c->quotas.For("").max_pinned_prefix_pages, 0);  // 0 = no limit
  EXPECT_EQ(a.max_decode_channels, 3);
  EXPECT_EQ(c->quotas.For("unlisted").max_decode_channels, 0);  // no limit
  const TenantQuota& none = c->quotas.For("");
  EXPECT_DOUBLE_EQ(none.max_memory_share, 1.0);
  EXPECT_EQ(none.max_pinned_pages, 100);
  EXPECT_EQ(none.max_lease_ms, 5000);
  EXPECT_DOUBLE_EQ(c->quotas.For("unlisted").max_memory_share, 0.5);
  // Without a quotas section nothing is limited.
  auto d = ParseConfig("listen: 127.0.0.1:1");
  ASSERT_TRUE(d.ok());
  EXPECT_DOUBLE_EQ(d->quotas.For("x").max_memory_share, 1.0);
  EXPECT_EQ(d->quotas.For("x").max_models, 0);
  EXPECT_EQ(d->quotas.For("x").max_model_bytes, 0u);

  struct Case {
    const char* yaml;
    const char* needle;
  };
  const Case bad[] = {
      {"quotas: {default: {max_memory_share: 0}}",
       "quotas.default.max_memory_share is 0, expected a number in (0, 1]"},
      {"quotas: {default: {max_memory_share: 1.5}}", "max_memory_share is 1.5"},
      {"quotas: {default: {max_memory_share: -0.1}}", "max_memory_share is -0.1"},
      {"quotas: {default: {max_memory_share: .nan}}", "max_memory_share is nan"},
      {"quotas: {default: {max_memory_share: half}}",
       "quotas.default.max_memory_share has value 'half' of the wrong type"},
      {"quotas: {tenants: [{tenant: a, max_models: -1}]}",
       "quotas.tenants[0].max_models is -1, expected >= 0"},
      {"quotas: {tenants: [{tenant: a, max_pinned_prefix_pages: -3}]}",
       "quotas.tenants[0].max_pinned_prefix_pages is -3, expected >= 0"},
      {"quotas: {tenants: [{tenant: a, max_decode_channels: -2}]}",
       "quotas.tenants[0].max_decode_channels is -2, expected >= 0"},
      {"quotas: {tenants: [{tenant: a, max_models: lots}]}",
       "quotas.tenants[0].max_models has value 'lots' of the wrong type"},
      {"quotas: {default: {max_model_bytes: 12XB}}", "quotas.default.max_model_bytes is '12XB'"},
      {"quotas: {default: {max_model_bytes: -5}}",
       "quotas.default.max_model_bytes is -5, expected >= 0"},
      {"quotas: {default: {max_memory: 0.5}}",
       "unknown key 'quotas.default.max_memory'; expected one of"},
      {"quotas: {tenants: [{max_models: 1}]}", "quotas.tenants[0].tenant is missing"},
      {"quotas: {tenants: [{tenant: a}, {tenant: a}]}", "tenant 'a' appears twice"},
      {"quotas: {tenants: {tenant: a}}", "quotas.tenants must be a list"},
  };
  for (const auto& b : bad) {
    auto r = ParseConfig(b.yaml);
    ASSERT_FALSE(r.ok()) << b.yaml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.yaml;
    EXPECT_NE(r.status().message().find(b.needle), std::string::npos)
        << b.yaml << " -> " << r.status().message();
  }
}

TEST(ConfigTest, MaxPinTtl) {
  auto d = ParseConfig("listen: 127.0.0.1:1");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->max_pin_ttl_ms, 86400000);  // 24 h
  auto c = ParseConfig("max_pin_ttl_ms: 5000");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_pin_ttl_ms, 5000);
  for (const char* bad : {"max_pin_ttl_ms: 0", "max_pin_ttl_ms: -1"}) {
    auto r = ParseConfig(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("max_pin_ttl_ms is"), std::string::npos)
        << r.status().message();
  }
}

TEST(ConfigTest, FsqModelProfile) {
  auto c = ParseConfig(R"(
models:
  - builtin: tiny
    name: tiny-fsq
    history_format: fsq
    fsq_residual_width: 64
    fsq_latent_width: 21
    key_norm: rms
    key_norm_eps: 1e-5
    codec_file: /tmp/codec.safetensors
    rope: {theta: 1e6, rotary_dims: 8, pairing: interleaved}
)");
  ASSERT_TRUE(c.ok()) << c.status();
  const ModelSpec& m = c->models[0];
  EXPECT_EQ(m.history_format, FormatId::kFsq);
  EXPECT_EQ(m.fsq_residual_width, 64);
  EXPECT_EQ(m.fsq_latent_width, 21);
  EXPECT_TRUE(m.key_norm);
  EXPECT_FLOAT_EQ(m.key_norm_eps, 1e-5f);
  EXPECT_TRUE(m.rope_interleaved);
  EXPECT_EQ(m.rotary_dims(), 8);
  EXPECT_EQ(m.codec_file, "/tmp/codec.safetensors");
}

// check-config opens the codec files as serve does (CheckModelCodecs: the formats'
// factories): a missing, malformed or mismatched file is refused, naming codec_file.
TEST(ConfigTest, CheckModelCodecsOpensEachCodecFile) {
  const std::string dir = ::testing::TempDir();
  FsqCodecShape shape;
  shape.num_layers = 2;
  shape.residual_width = 64;
  shape.latent_width = 21;
  shape.num_kv_heads = 2;
  shape.head_dim = 16;
  const std::string good = dir + "/check_config_fsq.safetensors";
  std::ofstream(good, std::ios::binary)
      << FsqCodec::Synthetic(shape, 1).ToSafetensors().Serialize();
  shape.latent_width = 20;
  const std::string mismatched = dir + "/check_config_fsq_g20.safetensors";
  std::ofstream(mismatched, std::ios::binary)
      << FsqCodec::Synthetic(shape, 1).ToSafetensors().Serialize();
  const std::string garbage = dir + "/check_config_garbage.safetensors";
  std::ofstream(garbage, std::ios::binary) << "not safetensors";
  const auto config = [](const std::string& history, const std::string& codec_file) {
    return ParseConfig(R"(
models:
  - builtin: tiny
    name: m
    history_format: )" +
                       history + R"(
    fsq_residual_width: )" +
                       (history == "fsq" ? "64" : "0") + R"(
    fsq_latent_width: )" +
                       (history == "fsq" ? "21" : "0") + R"(
    codec_file: )" + codec_file +
                       "\n");
  };
  auto ok = config("fsq", good);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(CheckModelCodecs(*ok).ok()) << CheckModelCodecs(*ok);
  const struct {
    std::string history, file, says;
  } bad[] = {
      {"fsq", dir + "/no_such_codec.safetensors", "codec_file '" + dir + "/no_such_codec"},
      {"fsq", garbage, "codec_file '" + garbage + "'"},
      {"fsq", mismatched, "'latent_width' is '20', expected 21"},
      {"int2-oscar", dir + "/no_such_codec.safetensors", "codec_file '" + dir + "/no_such_codec"},
      {"int2-oscar", garbage, "codec_file '" + garbage + "'"},
  };
  for (const auto& b : bad) {
    auto c = config(b.history, b.file);
    ASSERT_TRUE(c.ok()) << c.status();  // parsing does not open files
    const absl::Status s = CheckModelCodecs(*c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.file;
    EXPECT_NE(s.message().find(b.says), std::string::npos) << s;
    EXPECT_NE(s.message().find("model 'm': codec_file"), std::string::npos) << s;
    EXPECT_EQ(s.message().find("codec_blob"), std::string::npos) << s;
  }
}

TEST(ConfigTest, ClusterSection) {
  auto none = ParseConfig("listen: 127.0.0.1:6000\n");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->cluster.present);
  EXPECT_FALSE(none->cluster.has_peers());

  auto c = ParseConfig(R"(
cluster:
  name: prod-1
  member_id: kvcd-0
  membership: etcd
  etcd_endpoints: [127.0.0.1:2379, "[::1]:2379"]
  lease_ttl_s: 2
  redis_url: redis://127.0.0.1:6380
  load_interval_ms: 100
  events_endpoint: tcp://127.0.0.1:5557
  events_replay_endpoint: tcp://127.0.0.1:5558
  events_buffer: 50
  advertise_address: 10.0.0.7:50051
)");
  ASSERT_TRUE(c.ok()) << c.status();
  const ClusterConfig& k = c->cluster;
  EXPECT_TRUE(k.present);
  EXPECT_TRUE(k.has_peers());
  EXPECT_EQ(k.name, "prod-1");
  EXPECT_EQ(k.member_id, "kvcd-0");
  EXPECT_EQ(k.MembersPrefix(), "/kvcd/prod-1/members/");
  EXPECT_EQ(k.etcd_endpoints, (std::vector<std::string>{"127.0.0.1:2379", "[::1]:2379"}));
  EXPECT_EQ(k.lease_ttl_s, 2);
  EXPECT_EQ(k.load_interval_ms, 100);
  EXPECT_EQ(k.events_buffer, 50);
  EXPECT_EQ(k.advertise_address, "10.0.0.7:50051");
  std::string host;
  int port = 0;
  ASSERT_TRUE(ParseRedisUrl(k.redis_url, &host, &port).ok());
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 6380);
  ASSERT_TRUE(ParseRedisUrl("redis://redis.kvcd.svc", &host, &port).ok());
  EXPECT_EQ(port, 6379);

  // DNS membership with auth on names the token it calls its peers with.
  auto with_token = ParseConfig(
      "auth: {tokens_file: /t.yaml}\ncluster: {membership: dns, dns_name: kvcd, "
      "peer_token_file: /run/secrets/peer-token}\n");
  ASSERT_TRUE(with_token.ok()) << with_token.status();
  EXPECT_EQ(with_token->cluster.peer_token_file, "/run/secrets/peer-token");

  // Defaults: the member id is the hostname.
  auto d = ParseConfig("cluster: {}\n");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->cluster.present);
  EXPECT_FALSE(d->cluster.has_peers());
  EXPECT_EQ(d->cluster.name, "kvcd");
  EXPECT_EQ(d->cluster.lease_ttl_s, 10);
  EXPECT_EQ(d->cluster.load_interval_ms, 500);
  EXPECT_FALSE(d->cluster.member_id.empty());

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"cluster: {membership: etcd}", "etcd_endpoints is empty"},
      {"cluster: {membership: dns}", "dns_name is empty"},
      {"cluster: {membership: zookeeper}", "membership"},
      {"cluster: {name: 'a{b}'}", "cluster.name"},
      {"cluster: {member_id: 'a:b'}", "cluster.member_id"},
      {"cluster: {lease_ttl_s: 1}", "cluster.lease_ttl_s"},
      {"cluster: {load_interval_ms: 0}", "cluster.load_interval_ms"},
      {"cluster: {membership: etcd, etcd_endpoints: [a:1], redis_url: 'http://x:1'}",
       "cluster.redis_url"},
      {"cluster: {membership: etcd, etcd_endpoints: [a:1], redis_url: 'redis://x:99999'}",
       "out of range"},
      {"cluster: {redis_url: 'redis://x:1'}", "needs cluster.membership"},
      {"cluster: {events_replay_endpoint: 'tcp://127.0.0.1:1'}", "needs cluster.events_endpoint"},
      {"cluster: {events_endpoint: 'ipc:///tmp/x'}", "cluster.events_endpoint"},
      {"cluster: {bogus: 1}", "bogus"},
      {"auth: {tokens_file: /t.yaml}\ncluster: {membership: dns, dns_name: kvcd}",
       "cluster.peer_token_file is empty"},
  };
  for (const auto& [yaml, want] : bad) {
    auto r = ParseConfig(yaml);
    ASSERT_FALSE(r.ok()) << yaml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << yaml;
    EXPECT_NE(r.status().message().find(want), std::string::npos)
        << yaml << " -> " << r.status().message();
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

}  // namespace config_test
}  // namespace kvcd
