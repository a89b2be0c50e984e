// Transform-coded INT2 history pages (codec file version 3, common/key_transform_profile.h):
// keys as a per-KV-head transform code with uneven bits across the eigen-directions of a
// query-whitened basis, values as OSCAR INT2 with one rotation and clip per KV head; layout
// of one layer of one page in kvcd/kernels/transform_attention.h, key codec in
// kvcd/kernels/transform_codec.h. Written whole (Put: quantize-on-put) or re-encoded from
// full BF16 window pages (Demote). The model's window stores rows as given (no shared
// rotation): this format applies its per-head value rotations itself and attends on the
// codes (queries projected once per call, one inverse value rotation per head).
#pragma once

#include <memory>

#include "common/key_transform_profile.h"
#include "server/formats/cpu_page_format.h"

namespace kvcd {

// The profile must match the geometry (KeyTransformProfile::FromSafetensors checked it).
std::unique_ptr<CpuPageFormat> MakeInt2TransformCpuFormat(
    const PageGeometry& geometry, std::shared_ptr<const KeyTransformProfile> profile);

}  // namespace kvcd
