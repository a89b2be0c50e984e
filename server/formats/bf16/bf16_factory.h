// The bf16 line of the format registry (format_registry.h): its codec loader and
// format builder (bf16_factory.cc).
#pragma once

#include "server/formats/format_registry.h"

namespace kvcd {

FormatFactory Bf16Factory();

}  // namespace kvcd
