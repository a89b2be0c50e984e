// FormatId: the one spelling of a page format inside the daemon. Its names ("bf16",
// "int2-oscar") are what configs, the API's page descriptions and metrics use.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace kvcd {

enum class FormatId : int32_t { kBf16 = 0, kInt2Oscar = 1 };

const char* FormatName(FormatId id);

// Parses a format name; INVALID_ARGUMENT naming `field` and the accepted names otherwise.
absl::Status ParseFormatName(const std::string& name, const char* field, FormatId* out);

}  // namespace kvcd
