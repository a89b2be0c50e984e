// The config's JSON Schema (server/config/kvcd-config.schema.json, compiled into the binary)
// and the validator of the part of JSON Schema it uses. The schema is the one source of the
// config's structure: the keys, their types and ranges. deploy/tools/sync_generated.py
// derives the Helm chart's values.schema.json `config` subtree from the same file.
//
// Why a validator of our own: Debian 12 packages no JSON Schema validator for C++ (nor for
// nlohmann::json), and the schema needs only a few keywords. Any other keyword in the schema
// is an error (CheckSchemaKeywords; a unit test runs it on the embedded schema), so the
// schema can never ask for a check that the daemon silently skips.
#pragma once

#include <nlohmann/json.hpp>

#include "absl/status/status.h"

namespace kvcd {

// The embedded schema, parsed once.
const nlohmann::json& ConfigSchema();

// OK when every subschema of `schema` uses only the keywords ValidateJson implements (and
// annotations), and every $ref points into #/definitions; else INTERNAL naming the keyword.
absl::Status CheckSchemaKeywords(const nlohmann::json& schema);

// Checks `doc` against `schema`. INVALID_ARGUMENT names the key as the config writes it
// (`models[0].head_dim`) and what was expected, e.g. "unknown key 'models[0].colour';
// expected one of: ...", "lease.default_ms is 5, expected >= 10", "quotas.tenants[0].tenant
// is missing". The first error found is reported.
absl::Status ValidateJson(const nlohmann::json& doc, const nlohmann::json& schema);

}  // namespace kvcd
