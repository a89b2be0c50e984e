// Conversions between the wire's ModelProfile (proto/kvcd.proto) and the formats' ModelSpec
// (server/formats/model_spec.h).
#pragma once

#include "kvcd/v1/kvcache.pb.h"
#include "server/formats/model_spec.h"

namespace kvcd {

// Converts a v1 profile to a spec (0 rope.theta/scaling mean the defaults 10000 / 1). The
// profile's history_format must be one the registry knows (checked by the caller).
ModelSpec SpecFromProfile(const v1::ModelProfile& p);
void ProfileFromSpec(const ModelSpec& s, v1::ModelProfile* p);

}  // namespace kvcd
