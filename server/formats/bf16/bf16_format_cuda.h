// The CUDA implementation of BF16 pages (CUDA builds only).
#pragma once

#include <memory>

#include "server/formats/cuda_page_format.h"

namespace kvcd {

std::unique_ptr<PageFormat> MakeBf16CudaFormat(const PageGeometry& geometry,
                                               std::shared_ptr<const CodecProfile> rotation,
                                               std::shared_ptr<const CudaCodec> device_codec);

}  // namespace kvcd
