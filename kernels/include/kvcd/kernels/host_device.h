// KVCD_HOST_DEVICE marks small layout helpers that host code and CUDA kernels share.
#pragma once

#if defined(__CUDACC__)
#define KVCD_HOST_DEVICE __host__ __device__
#else
#define KVCD_HOST_DEVICE
#endif
