// The fsq line of the format registry (format_registry.h): its codec loader and
// format builder (fsq_factory.cc).
#pragma once

#include "server/formats/format_registry.h"

namespace kvcd {

FormatFactory FsqFactory();

}  // namespace kvcd
