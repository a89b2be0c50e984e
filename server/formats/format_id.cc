#include "server/formats/format_id.h"

#include "absl/strings/str_cat.h"

namespace kvcd {

const char* FormatName(FormatId id) {
  switch (id) {
    case FormatId::kBf16:
      return "bf16";
    case FormatId::kInt2Oscar:
      return "int2-oscar";
    case FormatId::kFsq:
      return "fsq";
    case FormatId::kFsqWindow:
      return "bf16+fsq";
    case FormatId::kInt2Transform:
      return "int2-transform";
  }
  return "unknown";
}

absl::Status ParseFormatName(const std::string& name, const char* field, FormatId* out) {
  // History formats a config may name (the window format follows from the history).
  for (FormatId id : {FormatId::kBf16, FormatId::kInt2Oscar, FormatId::kFsq}) {
    if (name == FormatName(id)) {
      *out = id;
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(field, " is '", name.substr(0, 64),
                                                 "', expected 'bf16', 'int2-oscar' or 'fsq'"));
}

}  // namespace kvcd
