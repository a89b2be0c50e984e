// The CUDA implementation of int2-transform pages (int2_transform_format.h): the same page
// layout in device memory; keys encoded and values quantized on the device by one row-store
// launch pair for every layer (cuda_transform.h LaunchStoreTransformRows: the CPU codecs'
// bytes bit for bit) from request rows, a worker's CUDA IPC buffer or a BF16 window page
// being demoted; attention on the codes by the transform decode kernel, whose parts (in the
// original value space) the backend merges with the BF16 windows' parts. CUDA builds only.
#pragma once

#include <memory>

#include "server/formats/cuda_page_format.h"
#include "server/formats/int2_transform/int2_transform_format.h"
#include "server/formats/int2_transform/transform_device_codec.h"

namespace kvcd {

// Whether the CUDA kernels serve an int2-transform model of this geometry and profile: OK,
// or INVALID_ARGUMENT naming what they need (head_dim 64, 128 or 256; page_size a multiple
// of 32; key code bytes at most head_dim; the profile's shape the geometry's). Host only: no
// device needed. (The GQA group, at most kernels::cuda::kTransformCudaMaxGroup, is checked
// at attention time: the geometry does not hold the query heads.)
absl::Status CheckTransformCudaGeometry(const PageGeometry& geometry,
                                        const KeyTransformProfile& profile);

// REQUIRES: CheckTransformCudaGeometry(geometry, *profile) is OK; device_codec uploaded from
// profile.
std::unique_ptr<PageFormat> MakeInt2TransformCudaFormat(
    const PageGeometry& geometry, std::shared_ptr<const KeyTransformProfile> profile,
    std::shared_ptr<const TransformDeviceCodec> device_codec);

}  // namespace kvcd
