// The process's CUDA device (SetDevice, cuda_runtime_api.h) made current on whichever host
// thread calls into the kernels' host API. Host code only: included by .cu and .cc files.
#pragma once

#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

// Makes the process's device current on the calling thread unless it already is (one
// thread-local compare once bound); a no-op until SetDevice was called, so a process that
// picks its devices with cudaSetDevice itself (tests, workers) keeps doing so. The CUDA
// error if the device cannot be made current.
Error BindThread();

}  // namespace kvcd::kernels::cuda

// The first statement of every host API entry point that reaches the CUDA runtime, the
// driver or NCCL: returns BindThread's error from it.
#define KVCD_CUDA_BIND_THREAD()                                                                    \
  do {                                                                                             \
    if (::kvcd::kernels::Error kvcd_bind_ = ::kvcd::kernels::cuda::BindThread(); !kvcd_bind_.ok()) \
      return kvcd_bind_;                                                                           \
  } while (0)
