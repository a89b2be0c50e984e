// The int2-transform line of the format registry (format_registry.h): its codec loader and
// format builder (int2_transform_factory.cc).
#pragma once

#include "server/formats/format_registry.h"

namespace kvcd {

FormatFactory Int2TransformFactory();

}  // namespace kvcd
