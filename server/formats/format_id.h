// FormatId: the one spelling of a page format inside the daemon. Its names ("bf16",
// "int2-oscar", "int2-transform", "fsq", "bf16+fsq"), API ids and config names are the
// format registry's (format_registry.h), which defines the functions below.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace kvcd {

// kFsqWindow: the BF16 window pages of an FSQ model, with each token's FSQ code beside
// its K/V (codes are computed when the residuals arrive, so demotion only copies them).
// kInt2Transform: the history of an int2-oscar model registered with a version-3 codec file
// (transform-coded keys); selected by the file, not named in configs.
enum class FormatId : int32_t {
  kBf16 = 0,
  kInt2Oscar = 1,
  kFsq = 2,
  kFsqWindow = 3,
  kInt2Transform = 4
};

const char* FormatName(FormatId id);

// Parses a history format name a config may give; INVALID_ARGUMENT naming `field` and the
// accepted names otherwise.
absl::Status ParseFormatName(const std::string& name, const char* field, FormatId* out);

}  // namespace kvcd
