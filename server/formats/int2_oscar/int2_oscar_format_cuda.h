// The CUDA implementation of OSCAR INT2 pages (CUDA builds only).
#pragma once

#include <memory>

#include "server/formats/cuda_page_format.h"

namespace kvcd {

// device_codec is required (rotations and clip ratios on the device).
std::unique_ptr<PageFormat> MakeInt2OscarCudaFormat(const PageGeometry& geometry,
                                                    std::shared_ptr<const CodecProfile> codec,
                                                    std::shared_ptr<const CudaCodec> device_codec);

}  // namespace kvcd
