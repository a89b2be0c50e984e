// A replay's report: text for people, JSON for scripts (the same figures).
#pragma once

#include <string>

#include "bench/replay/replay.h"

namespace kvcd::replay {

std::string ReportText(const ReplayReport& r, const std::string& trace_name);
std::string ReportJson(const ReplayReport& r, const std::string& trace_name);

}  // namespace kvcd::replay
