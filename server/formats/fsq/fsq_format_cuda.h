// The CUDA implementation of the two FSQ formats (fsq_format.h): the same page layouts in
// device memory; codes computed on the device from the residuals (cuda_fsq.h
// LaunchFsqEncodeRows, bit-identical to the CPU encoder, or the tensor-core encoder of
// cuda_fsq_encode_tc.h as FsqDeviceCodec::encoder() says), demotion a device copy of the
// window page's codes, history attention by the FSQ decode kernel (keys rebuilt on tensor
// cores from the codes, never written), window attention by the BF16 decode kernel; the
// backend merges both. CUDA builds only.
#pragma once

#include <memory>

#include "server/formats/cuda_page_format.h"
#include "server/formats/fsq/fsq_device_codec.h"
#include "server/formats/fsq/fsq_format.h"

namespace kvcd {

// Whether the CUDA kernels serve an FSQ model of this geometry and codec: OK, or
// INVALID_ARGUMENT naming what they need (head_dim 64, 128 or 256; page_size a multiple of
// 16; RoPE rotary_dims even, <= head_dim, a multiple of 16 with the half pairing; G at most
// kernels::cuda::kFsqCudaMaxLatent; the codec's shape the geometry's). Host only: no device
// needed.
absl::Status CheckFsqCudaGeometry(const PageGeometry& geometry, const FsqModelCodec& codec);

// REQUIRES: CheckFsqCudaGeometry(geometry, *codec) is OK; device_codec uploaded from codec.
std::unique_ptr<PageFormat> MakeFsqCudaFormat(const PageGeometry& geometry,
                                              std::shared_ptr<const FsqModelCodec> codec,
                                              std::shared_ptr<const FsqDeviceCodec> device_codec);
std::unique_ptr<PageFormat> MakeFsqWindowCudaFormat(
    const PageGeometry& geometry, std::shared_ptr<const FsqModelCodec> codec,
    std::shared_ptr<const FsqDeviceCodec> device_codec);

}  // namespace kvcd
