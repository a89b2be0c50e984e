// CudaSideStream: the CUDA backend's second stream, beside the daemon's (legacy) stream, and
// the rows a pipelined call stored on it. Two users fork it: Attend, which runs the BF16
// windows there beside the history's attention, and a pipelined call's row store (the
// backend's RowStream), whose rows every later launch that reads them must be ordered after
// (JoinPendingRows). Created on first use. Not thread-safe: the backend's mutex guards it.
#pragma once

#include "kvcd/kernels/error.h"

namespace kvcd {

class CudaSideStream {
 public:
  // The side stream waits for everything queued so far on the daemon's stream (it is created
  // first if needed). `rows`: what follows on it is a row store (JoinPendingRows joins it).
  kernels::Error Fork(bool rows = false);
  // The daemon's stream waits for everything queued so far on the side stream; rows stored
  // there are joined with it.
  kernels::Error Join();
  // Join(), if rows stored on the side stream have not been joined yet; else nothing.
  kernels::Error JoinPendingRows();
  // For a caller whose launch on the daemon's stream waits on the device for a word the side
  // stream writes after everything queued on it so far (MergeTarget::wait_word): that launch
  // joined it, so the rows stored there need no Join.
  void JoinedOnDevice() { rows_pending_ = false; }
  // The stream (cudaStream_t), null before the first Fork.
  void* stream() const { return stream_; }

 private:
  void* stream_ = nullptr;
  void* fork_event_ = nullptr;
  void* join_event_ = nullptr;
  bool rows_pending_ = false;
};

}  // namespace kvcd
