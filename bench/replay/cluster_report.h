// The cluster target's figures as JSON (kvcd-replay --cluster-json): per-member requests and
// pages held (and max/mean), lookup latency percentiles, pulls and replications.
#pragma once

#include <string>

#include "bench/replay/cluster_target.h"

namespace kvcd::replay {

std::string ClusterFiguresJson(const ClusterFigures& f);

}  // namespace kvcd::replay
