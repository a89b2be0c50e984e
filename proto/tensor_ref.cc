#include "tensor_ref.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checked_math.h"
#include "kvcd/kernels/bf16.h"

namespace kvcd {

int DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
    case v1::DTYPE_F16:
      return 2;
    case v1::DTYPE_F32:
      return 4;
    case v1::DTYPE_U8:
      return 1;
    default:
      return 0;
  }
}

const char* DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return "BF16";
    case v1::DTYPE_F16:
      return "F16";
    case v1::DTYPE_F32:
      return "F32";
    case v1::DTYPE_U8:
      return "U8";
    default:
      return "UNSPECIFIED";
  }
}

absl::Status CheckTensorRef(const v1::TensorRef& t, absl::string_view field,
                            absl::Span<const int64_t> expected_shape,
                            std::initializer_list<v1::DType> allowed) {
  bool dtype_ok = false;
  std::vector<std::string> names;
  for (v1::DType d : allowed) {
    dtype_ok |= (t.dtype() == d);
    names.push_back(DTypeName(d));
  }
  if (!dtype_ok) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype is ", DTypeName(t.dtype()),
                                                   ", expected one of ",
                                                   absl::StrJoin(names, ", ")));
  }
  std::vector<std::string> want;
  for (int64_t e : expected_shape) want.push_back(e < 0 ? "*" : absl::StrCat(e));
  const std::string want_str = absl::StrCat("[", absl::StrJoin(want, ", "), "]");
  bool shape_ok = t.shape_size() == static_cast<int>(expected_shape.size());
  for (int i = 0; shape_ok && i < t.shape_size(); ++i) {
    shape_ok = t.shape(i) >= 0 && (expected_shape[i] < 0 || t.shape(i) == expected_shape[i]);
  }
  if (!shape_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape is [", absl::StrJoin(t.shape(), ", "), "], expected ", want_str));
  }
  int64_t bytes = DTypeSize(t.dtype());
  for (int64_t dim : t.shape()) {
    auto next = CheckedMul(bytes, dim);
    if (!next) return absl::InvalidArgumentError(absl::StrCat(field, ".shape overflows int64"));
    bytes = *next;
  }
  if (t.payload_case() == v1::TensorRef::kCudaIpc || t.payload_case() == v1::TensorRef::kNccl) {
    const uint64_t size =
        t.payload_case() == v1::TensorRef::kCudaIpc ? t.cuda_ipc().size() : t.nccl().size();
    if (size != static_cast<uint64_t>(bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, t.payload_case() == v1::TensorRef::kCudaIpc ? ".cuda_ipc" : ".nccl", ".size is ",
          size, ", expected ", bytes, " for shape ", want_str, " ", DTypeName(t.dtype())));
    }
    return absl::OkStatus();
  }
  if (t.payload_case() != v1::TensorRef::kInlineData) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has no payload; set inline_data (or cuda_ipc / nccl where served)"));
  }
  if (static_cast<int64_t>(t.inline_data().size()) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".inline_data has ", t.inline_data().size(), " bytes, expected ", bytes,
                     " for shape ", want_str, " ", DTypeName(t.dtype())));
  }
  return absl::OkStatus();
}

float ElementAsFloat(const v1::TensorRef& t, int64_t i) {
  const char* p = t.inline_data().data();
  if (t.dtype() == v1::DTYPE_F32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return kernels::Bf16ToFloat(b);
}

void CopyAsFloat(const v1::TensorRef& t, int64_t begin, int64_t n, float* out) {
  const char* p = t.inline_data().data();
  if (t.dtype() == v1::DTYPE_F32) {
    std::memcpy(out, p + 4 * begin, static_cast<size_t>(4 * n));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, p + 2 * (begin + i), 2);
    out[i] = kernels::Bf16ToFloat(b);
  }
}

namespace {
void SetInline(v1::TensorRef* t, v1::DType dtype, std::vector<int64_t> shape, const void* data,
               int64_t bytes) {
  t->Clear();
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_inline_data(static_cast<const char*>(data), static_cast<size_t>(bytes));
}
int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

void SetF32Tensor(v1::TensorRef* t, std::vector<int64_t> shape, const float* data) {
  const int64_t n = Product(shape);
  SetInline(t, v1::DTYPE_F32, std::move(shape), data, n * 4);
}

void SetBf16Tensor(v1::TensorRef* t, std::vector<int64_t> shape, const uint16_t* data) {
  const int64_t n = Product(shape);
  SetInline(t, v1::DTYPE_BF16, std::move(shape), data, n * 2);
}

void SetBf16FromFloat(v1::TensorRef* t, std::vector<int64_t> shape, const float* data) {
  const int64_t n = Product(shape);
  t->Clear();
  t->set_dtype(v1::DTYPE_BF16);
  for (int64_t d : shape) t->add_shape(d);
  std::string* bytes = t->mutable_inline_data();
  bytes->resize(static_cast<size_t>(2 * n));
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t b = kernels::FloatToBf16(data[i]);
    std::memcpy(bytes->data() + 2 * i, &b, 2);
  }
}

int64_t TensorBytes(v1::DType dtype, const std::vector<int64_t>& shape) {
  return DTypeSize(dtype) * Product(shape);
}

void SetIpcTensor(v1::TensorRef* t, v1::DType dtype, std::vector<int64_t> shape, uint64_t buffer_id,
                  uint64_t offset) {
  t->Clear();
  t->set_dtype(dtype);
  const int64_t bytes = TensorBytes(dtype, shape);
  for (int64_t d : shape) t->add_shape(d);
  t->mutable_cuda_ipc()->set_buffer_id(buffer_id);
  t->mutable_cuda_ipc()->set_offset(offset);
  t->mutable_cuda_ipc()->set_size(static_cast<uint64_t>(bytes));
}

}  // namespace kvcd
