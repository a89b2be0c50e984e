// The config schema (server/config/kvcd-config.schema.json) and the daemon agree: the
// validator implements every keyword the schema uses, the schema's enumerations are the
// daemon's registries, and every key the schema accepts is read by ParseConfig, except the
// keys of work in progress listed here.
#include "server/config/config_schema.h"

#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "server/config/config.h"
#include "server/formats/format_registry.h"
#include "server/formats/model_spec.h"

namespace kvcd {
namespace config_schema_test {

using nlohmann::json;

// Keys in the schema (x-kvcd-status "in progress") that no C++ reads yet: the daemon refuses
// them. Remove a key here when its C++ side lands.
const std::set<std::string> kPending = {};

const json& Resolved(const json& s) {
  if (!s.contains("$ref")) return s;
  const std::string ref = s["$ref"].get<std::string>();
  return ConfigSchema()["definitions"][ref.substr(std::string("#/definitions/").size())];
}

// A value the schema accepts for a leaf.
json Sample(const json& leaf) {
  const json& s = Resolved(leaf);
  if (leaf.contains("default")) return leaf["default"];
  if (s.contains("enum")) return s["enum"].back();
  const json type = s.contains("type") ? s["type"] : json("string");
  const std::string t = type.is_array() ? type[0].get<std::string>() : type.get<std::string>();
  if (t == "integer") return s.value("minimum", 1);
  if (t == "number") return 0.5;
  if (t == "boolean") return true;
  return "x";
}

struct Leaf {
  std::string path;  // as errors name it: quotas.tenants[0].max_models
  json doc;          // a config with just this key (and what its parents require)
};

// Every leaf key of `schema` under `path`; `wrap` puts a value where the key belongs.
void Leaves(const json& schema, const std::string& path, const std::function<json(json)>& wrap,
            std::vector<Leaf>* out) {
  const json& s = Resolved(schema);
  if (s.contains("properties")) {
    for (const auto& [k, sub] : s["properties"].items()) {
      const std::string child = path.empty() ? k : path + "." + k;
      Leaves(
          sub, child,
          [&, k = k](json v) {
            return wrap(json{{k, std::move(v)}});
          },
          out);
    }
    return;
  }
  if (s.contains("items") && !Resolved(s["items"]).contains("properties")) {
    // A list of scalars (cluster.etcd_endpoints): one element.
    Leaves(
        s["items"], path + "[0]", [&](json v) { return wrap(json::array({std::move(v)})); }, out);
    return;
  }
  if (s.contains("items")) {
    const json& item = Resolved(s["items"]);
    json required = json::object();
    for (const json& r : s["items"].value("required", json::array())) {
      required[r.get<std::string>()] = Sample(item["properties"][r.get<std::string>()]);
    }
    Leaves(
        s["items"], path + "[0]",
        [&, required](json v) {
          json entry = required;
          entry.update(v);
          return wrap(json::array({entry}));
        },
        out);
    return;
  }
  out->push_back({path, wrap(Sample(schema))});
}

TEST(ConfigSchemaTest, UsesOnlyTheKeywordsTheValidatorImplements) {
  EXPECT_TRUE(CheckSchemaKeywords(ConfigSchema()).ok()) << CheckSchemaKeywords(ConfigSchema());
  const json any_of = json::parse(R"({"properties": {"a": {"anyOf": [{"type": "string"}]}}})");
  const absl::Status s = CheckSchemaKeywords(any_of);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("'anyOf' at #/properties/a"), std::string::npos) << s;
  const json bad_ref = json::parse(R"({"properties": {"a": {"$ref": "#/definitions/none"}}})");
  EXPECT_EQ(CheckSchemaKeywords(bad_ref).code(), absl::StatusCode::kInternal);
}

TEST(ConfigSchemaTest, EnumerationsAreTheDaemonsRegistries) {
  const json& model = ConfigSchema()["definitions"]["model"]["properties"];
  std::set<std::string> builtins;
  for (const json& b : model["builtin"]["enum"]) builtins.insert(b.get<std::string>());
  const std::vector<std::string> names = BuiltinModelNames();
  EXPECT_EQ(builtins, std::set<std::string>(names.begin(), names.end()));
  std::set<std::string> formats, registry;
  for (const json& f : model["history_format"]["enum"]) formats.insert(f.get<std::string>());
  for (const FormatEntry& e : FormatRegistry()) {
    if (e.config_name[0] != '\0') registry.insert(e.config_name);
  }
  EXPECT_EQ(formats, registry);
}

TEST(ConfigSchemaTest, EveryKeyOfTheSchemaIsReadByTheDaemon) {
  std::vector<Leaf> leaves;
  Leaves(
      ConfigSchema(), "", [](json v) { return v; }, &leaves);
  ASSERT_GT(leaves.size(), 60u);
  std::set<std::string> pending_seen;
  for (const Leaf& leaf : leaves) {
    // JSON is YAML: quoted strings stay strings, numbers and booleans are plain.
    ASSERT_TRUE(ValidateJson(leaf.doc, ConfigSchema()).ok())
        << leaf.path << ": " << leaf.doc.dump() << ": " << ValidateJson(leaf.doc, ConfigSchema());
    auto c = ParseConfig(leaf.doc.dump(2));
    const bool unread =
        !c.ok() && c.status().message().find("does not implement it yet") != std::string::npos;
    if (kPending.count(leaf.path)) {
      EXPECT_TRUE(unread) << leaf.path << " is read now: remove it from kPending";
      EXPECT_NE(c.status().message().find("'" + leaf.path + "'"), std::string::npos) << c.status();
      pending_seen.insert(leaf.path);
    } else {
      EXPECT_FALSE(unread) << leaf.path << ": " << c.status();
    }
  }
  EXPECT_EQ(pending_seen, kPending);
}

TEST(ConfigSchemaTest, ErrorsNameTheKeyAndWhatWasExpected) {
  struct Case {
    const char* doc;
    const char* says;
  };
  const Case cases[] = {
      {R"({"lease": {"default_ms": 5}})", "lease.default_ms is 5, expected >= 10"},
      {R"({"cuda_device": 65})", "cuda_device is 65, expected 0..64"},
      {R"({"high_watermark": 0})", "high_watermark is 0, expected a number in (0, 1]"},
      {R"({"backend": "tpu"})", "backend is 'tpu', expected one of 'cpu', 'cuda'"},
      {R"({"listen": 5})", "listen has value 5 of the wrong type; expected a string (quote it)"},
      {R"({"listen": ""})", "listen must not be empty"},
      {R"({"models": [{"name": "m", "rope": {"pairing": 1}}]})",
       "models[0].rope.pairing is 1, expected one of 'half', 'interleaved'"},
      {R"({"models": [{"name": "m", "rope": 1}]})", "models[0].rope must be a mapping"},
      {R"({"quotas": {"tenants": [{"max_models": 1}]}})",
       "quotas.tenants[0].tenant is missing (the tenant's cache_salt (quotas.tenants entries "
       "only))"},
      {R"({"quotas": {"tenants": [{"tenant": "a", "colour": 1}]}})",
       "unknown key 'quotas.tenants[0].colour'; expected one of: max_decode_channels"},
      {R"({"memory_budget": "1 PB"})", "memory_budget is '1 PB', expected a size in bytes"},
      {R"([1])", "the config must be a mapping"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidateJson(json::parse(c.doc), ConfigSchema());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.doc;
    EXPECT_NE(s.message().find(c.says), std::string::npos) << c.doc << " -> " << s;
  }
  EXPECT_TRUE(ValidateJson(json::parse(R"({"memory_budget": "1.5 GB"})"), ConfigSchema()).ok());
  EXPECT_TRUE(ValidateJson(json::parse(R"({"memory_budget": 1024})"), ConfigSchema()).ok());
}

// The YAML a person writes: plain scalars take YAML's types, quoted ones are strings.
TEST(ConfigSchemaTest, YamlScalarsTakeTheirYamlTypes) {
  auto quoted = ParseConfig("models: [{builtin: tiny, name: '123'}]");
  ASSERT_TRUE(quoted.ok()) << quoted.status();
  EXPECT_EQ(quoted->models[0].name, "123");
  auto plain = ParseConfig("models: [{builtin: tiny, name: 123}]");
  ASSERT_FALSE(plain.ok());
  EXPECT_NE(plain.status().message().find("models[0].name has value 123 of the wrong type; "
                                          "expected a string (quote it)"),
            std::string::npos)
      << plain.status();
  auto number_as_size = ParseConfig("memory_budget: 1073741824");
  ASSERT_TRUE(number_as_size.ok()) << number_as_size.status();
  EXPECT_EQ(number_as_size->memory_budget_bytes, 1ull << 30);
  auto float_for_int = ParseConfig("max_sequences: 1.5");
  ASSERT_FALSE(float_for_int.ok());
  EXPECT_NE(float_for_int.status().message().find("max_sequences has value 1.5 of the wrong type"),
            std::string::npos)
      << float_for_int.status();
  // A key the schema does not have is refused by name (here a misspelling of
  // metrics_per_tenant).
  auto unknown = ParseConfig("per_tenant_metrics: true");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("unknown key 'per_tenant_metrics'"), std::string::npos)
      << unknown.status();
  // A billion laughs is refused, not expanded.
  std::string laughs = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n";
  for (char c = 'b'; c <= 'j'; ++c) {
    const char p = static_cast<char>(c - 1);
    laughs += std::string(1, c) + ": &" + c + " [*" + p + ", *" + p + ", *" + p + ", *" + p +
              ", *" + p + ", *" + p + ", *" + p + ", *" + p + ", *" + p + ", *" + p + "]\n";
  }
  auto big = ParseConfig(laughs);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("more than 100000 nodes"), std::string::npos)
      << big.status();
}

// A config whose keys or values are not UTF-8 (yaml-cpp does not check) is refused with a
// message, never an exception out of the JSON serializer (found by config_fuzz: the seed
// tests/fuzz/corpus/config_fuzz/non-utf8-key).
TEST(ConfigSchemaTest, NonUtf8KeysAndValuesAreRefusedNotThrown) {
  const std::string cases[] = {
      // A value of the wrong type shown in the message: a mapping with a non-UTF-8 key.
      "backend:\n    memo\x8e\x8d: 600MiB\n    bf16_fraction: 0.5\n",
      "listen: [\"\xff\xfe\"]\n",
      "models:\n  - builtin: tiny\n    memo\x8e\x8d: 600MiB\n",
  };
  for (const std::string& yaml : cases) {
    absl::StatusOr<ServerConfig> c;
    EXPECT_NO_THROW(c = ParseConfig(yaml)) << yaml;
    ASSERT_FALSE(c.ok()) << yaml;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  }
}

}  // namespace config_schema_test
}  // namespace kvcd
