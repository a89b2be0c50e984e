// Host-side CUDA device queries (only built when KVCD_CUDA is on).
#pragma once

#include <string>

namespace kvcd::kernels {

// Number of usable CUDA devices; 0 when there is no driver or no device.
int CudaDeviceCount();

// "NVIDIA H200 (sm_90, 139 GiB)" for device `ordinal`, or the CUDA error string.
std::string CudaDeviceDescription(int ordinal);

}  // namespace kvcd::kernels
