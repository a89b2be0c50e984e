// The int2-oscar line of the format registry (format_registry.h): its codec loader and
// format builder (int2_oscar_factory.cc).
#pragma once

#include "server/formats/format_registry.h"

namespace kvcd {

FormatFactory Int2OscarFactory();

}  // namespace kvcd
