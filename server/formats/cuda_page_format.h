// CudaPageFormat: what a format adds to run on the CUDA backend (pools in device memory):
// its decode-attention launch over the model's device rotations. A format's CUDA
// implementation is CudaFormat<its base class>: the base (layout, host checks, row
// expansion) plus this; the CUDA backend reaches it as PageFormat::cuda(). CUDA builds only.
#pragma once

#include <memory>
#include <utility>

#include "kvcd/kernels/cuda_decode_attention.h"
#include "server/formats/cuda_codec.h"
#include "server/formats/page_format.h"

namespace kvcd {

class CudaPageFormat {
 public:
  explicit CudaPageFormat(std::shared_ptr<const CudaCodec> device_codec)
      : device_codec_(std::move(device_codec)) {}
  virtual ~CudaPageFormat() = default;

  // The model's rotations in device memory; null when rows are stored as given.
  const CudaCodec* device_codec() const { return device_codec_.get(); }

  // One attention launch: parts [part_base, part_base + splits) of every (sequence, query
  // head) over the page list; with `merge` (formats whose FusesMerge() is true) the launch
  // also merges every part into the result; with merge->fold_counters (given to every
  // launch of the call, each format's FoldsMerge() true) the launches fold the merge into
  // their last CTAs (MergeTarget in cuda_decode_attention.h).
  struct AttendLaunch {
    kernels::cuda::PagedList list;
    kernels::cuda::DecodeGeometry geo;
    const float* q = nullptr;  // raw queries [batch][num_q_heads][head_dim]
    // Set: the worker's queries as they arrive, read (and checked) by the launch in place of q.
    const kernels::cuda::RawQueries* raw = nullptr;
    const float* r_k = nullptr;  // device, null = none
    float scale = 0;
    int splits = 0;
    int max_tokens = 0;
    float* part_o = nullptr;
    float* part_lse = nullptr;
    int part_base = 0;
    void* state = nullptr;  // AttendStateBytes(geo, max_tokens, num_sms) bytes of device scratch
    const kernels::cuda::MergeTarget* merge = nullptr;
    // Formats with NeedsPositions(): [batch] (device) the absolute position of token 0 of
    // each sequence's list (its pages of this format are consecutive in the sequence).
    const int64_t* positions = nullptr;
    int32_t layer = 0;  // the model layer the list's pool pages belong to
    int num_sms = 1;
    // The CUDA stream to launch on (cudaStream_t; null: the daemon's stream). Only formats
    // whose RunsOnSideStream() is true are given another one.
    void* stream = nullptr;
  };
  // How many parts the launch writes per row: splits that fill the GPU for a batch whose
  // longest page list holds max_tokens (each kernel's own count, sized for equal lengths),
  // or 1 for a format that merges its own splits. total_tokens > 0 (the lists' tokens
  // together; the backend passes it unless KVCD_SPLITS=kernel): sized by the longest list
  // when the lengths differ (kvcd/kernels/cuda_split_balance.h).
  virtual int AttendSplits(const kernels::cuda::DecodeGeometry& geo, int max_tokens,
                           int64_t total_tokens, int num_sms) const = 0;
  virtual size_t AttendStateBytes(const kernels::cuda::DecodeGeometry& geo, int max_tokens,
                                  int num_sms) const {
    return 0;
  }
  virtual bool FusesMerge() const { return false; }
  // True when LaunchAttend at `geo` takes its share of a folded merge (merge->fold_counters).
  virtual bool FoldsMerge(const kernels::cuda::DecodeGeometry& /*geo*/) const { return false; }
  // True when attention needs each token's absolute position (keys rebuilt with RoPE).
  virtual bool NeedsPositions() const { return false; }
  // True when LaunchAttend reads AttendLaunch::raw (the worker's queries in place) when it is
  // set; the backend converts the queries into `q` first unless every launched list does.
  virtual bool ReadsRawQueries() const { return false; }
  // True when LaunchAttend launches on AttendLaunch::stream, so that the backend may run the
  // list on a second stream beside another format's (the BF16 windows beside INT2 history).
  virtual bool RunsOnSideStream() const { return false; }
  virtual absl::Status LaunchAttend(const AttendLaunch& a) const = 0;

 private:
  const std::shared_ptr<const CudaCodec> device_codec_;
};

// The CUDA implementation of the format whose backend-independent base class is `Base`:
// constructed from the model's device rotations (null: none) and Base's arguments.
template <class Base>
class CudaFormat : public Base, public CudaPageFormat {
 public:
  template <class... Args>
  explicit CudaFormat(std::shared_ptr<const CudaCodec> device_codec, Args&&... args)
      : Base(std::forward<Args>(args)...), CudaPageFormat(std::move(device_codec)) {}
  const CudaPageFormat* cuda() const final { return this; }
};

}  // namespace kvcd
