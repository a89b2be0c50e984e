#include "server/daemon/grpc_log.h"

#include <grpc/support/log.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "server/daemon/protobuf_log.h"

namespace kvcd {
namespace {

LogRateLimiter& GrpcLimiter() {
  static LogRateLimiter* limiter = new LogRateLimiter(
      10, std::chrono::milliseconds(10000),
      [](const std::string& line) { KVCD_LOG(WARNING) << line; }, "gRPC");
  return *limiter;
}

void OnGrpcLog(gpr_log_func_args* args) {
  const char* level = args->severity == GPR_LOG_SEVERITY_ERROR  ? "ERROR"
                      : args->severity == GPR_LOG_SEVERITY_INFO ? "INFO"
                                                                : "DEBUG";
  GrpcLimiter().Log(absl::StrCat("grpc ", level, " ", args->file == nullptr ? "" : args->file, ":",
                                 args->line, ": ", args->message == nullptr ? "" : args->message),
                    std::chrono::steady_clock::now());
}

}  // namespace

void InstallRateLimitedGrpcLog() {
  GrpcLimiter();
  gpr_set_log_function(&OnGrpcLog);
}

}  // namespace kvcd
