// The checks CacheEngine makes on a request's input tensors before it routes them: the
// K/V shapes and dtypes, the payload kinds inputs may use, and the status of a sequence
// whose device inputs a pipelined kernel found non-finite. Where rows are and whether
// their values are finite (CacheEngine::Rows, CacheEngine::Residuals) is defined in
// tensor_checks.cc beside these.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kvcd/v1/kvcache.pb.h"
#include "server/cache/sequence.h"
#include "server/dataplane/tensor_resolver.h"
#include "server/formats/model_spec.h"

namespace kvcd {

// Input tensors (K/V, queries) come inline or from a registered device buffer.
constexpr int kInputKinds = TensorResolver::kInline | TensorResolver::kIpc;

// Checks K and V of n tokens for all layers: [L, n, Hkv, d], same dtype.
absl::Status CheckKv(const ModelSpec& s, const v1::TensorRef& k, const v1::TensorRef& v, int64_t n);

// INVALID_ARGUMENT once a pipelined call's kernel met a NaN/±Inf in the sequence's device
// inputs (Sequence::device_fault): every later call on it answers this.
// this_call: the caller waited for the kernels of the call it answers.
absl::Status DeviceFaultStatus(const Sequence& seq, bool this_call = false);

}  // namespace kvcd
