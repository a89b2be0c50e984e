// The one error type of the kernels' host API: every entry point that can fail (launchers,
// the CUDA runtime and NCCL host APIs) returns an Error; success is ok(). Framework-free:
// the server turns it into an absl::Status in one place (CudaStatus, server/formats/
// cuda_codec.h).
#pragma once

#include <string>
#include <utility>

namespace kvcd::kernels {

enum class ErrorCode {
  kOk = 0,
  kCuda,  // the CUDA runtime refused or failed a call, or a launcher refused its arguments
          // (cudaErrorInvalidValue): device_code() is the cudaError_t
  kNccl,  // NCCL is missing, failed or timed out
};

class Error {
 public:
  Error() = default;  // success
  Error(ErrorCode code, std::string message, int device_code = 0)
      : code_(code), device_code_(device_code), message_(std::move(message)) {}

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  // The cudaError_t of a kCuda error; 0 otherwise.
  int device_code() const { return device_code_; }
  // What went wrong ("" on success).
  const std::string& message() const { return message_; }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  int device_code_ = 0;
  std::string message_;
};

}  // namespace kvcd::kernels
