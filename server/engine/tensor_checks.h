// The checks CacheEngine makes on a request's input tensors before it routes them: the
// specs of K/V rows, residuals and queries (each resolved by the data plane in one call,
// TensorResolver::Resolve), the payload kinds inputs may use, and the status of a sequence
// whose device inputs a pipelined kernel found non-finite. The rows of resolved tensors
// (CacheEngine::Rows, CacheEngine::Residuals) are defined in request_rows.cc.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvcd/v1/kvcache.pb.h"
#include "server/cache/sequence.h"
#include "server/dataplane/tensor_resolver.h"
#include "server/formats/model_spec.h"

namespace kvcd {

// Input tensors (K/V, queries) come inline or from a registered device buffer.
constexpr int kInputKinds = TensorResolver::kInline | TensorResolver::kIpc;

// An input of `shape`, BF16 or F32, inline or cuda_ipc.
TensorSpec InputSpec(absl::string_view field, std::vector<int64_t> shape);

// INVALID_ARGUMENT once a pipelined call's kernel met a NaN/±Inf in the sequence's device
// inputs (Sequence::device_fault): every later call on it answers this.
// this_call: the caller waited for the kernels of the call it answers.
absl::Status DeviceFaultStatus(const Sequence& seq, bool this_call = false);

}  // namespace kvcd
