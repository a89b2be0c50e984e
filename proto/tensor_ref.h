// Validation and conversion of kvcd.v1.TensorRef payloads, shared by the daemon and
// the client library.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvcd/v1/kvcache.pb.h"

namespace kvcd {

// Bytes per element of a TensorRef dtype, 0 for UNSPECIFIED/unknown.
int DTypeSize(v1::DType dtype);
const char* DTypeName(v1::DType dtype);

// Checks that `t` has one of `allowed` dtypes, exactly `expected_shape` (-1 in
// expected_shape accepts any non-negative extent) and a payload of product(shape) * dtype
// size bytes (inline data, or a cuda_ipc region / nccl slot of that size; whether such a
// payload is served is the caller's decision). Returns INVALID_ARGUMENT naming `field`.
absl::Status CheckTensorRef(const v1::TensorRef& t, absl::string_view field,
                            absl::Span<const int64_t> expected_shape,
                            std::initializer_list<v1::DType> allowed);

// A cuda_ipc region of `buffer_id` at `offset` for a tensor of dtype / shape.
void SetIpcTensor(v1::TensorRef* t, v1::DType dtype, std::vector<int64_t> shape, uint64_t buffer_id,
                  uint64_t offset);
// Bytes of a tensor of dtype / shape.
int64_t TensorBytes(v1::DType dtype, const std::vector<int64_t>& shape);

// Element i of a checked BF16 / F32 tensor as float.
float ElementAsFloat(const v1::TensorRef& t, int64_t i);

// Copies a checked BF16/F32 tensor's elements [begin, begin + n) as floats.
void CopyAsFloat(const v1::TensorRef& t, int64_t begin, int64_t n, float* out);

// Fills `t` with an inline tensor.
void SetF32Tensor(v1::TensorRef* t, std::vector<int64_t> shape, const float* data);
void SetBf16Tensor(v1::TensorRef* t, std::vector<int64_t> shape, const uint16_t* data);
// Fills `t` with BF16 elements converted from floats.
void SetBf16FromFloat(v1::TensorRef* t, std::vector<int64_t> shape, const float* data);

}  // namespace kvcd
