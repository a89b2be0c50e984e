// The kernels' Error (kvcd/kernels/error.h) as an absl::Status: the one place the server
// converts it. kernels/ stays framework-free; every server call of a kernels host entry point
// that can fail goes through KernelStatus (or CudaStatus, its INTERNAL form).
#pragma once

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvcd/kernels/error.h"

namespace kvcd {

// OK for an ok() error; else `code` with "<context>: <what the kernels said><after>" (no
// context: the kernels' text alone).
inline absl::Status KernelStatus(const kernels::Error& error, absl::StatusCode code,
                                 absl::string_view context = {}, absl::string_view after = {}) {
  if (error.ok()) return absl::OkStatus();
  if (context.empty()) return absl::Status(code, absl::StrCat(error.message(), after));
  return absl::Status(code, absl::StrCat(context, ": ", error.message(), after));
}

// A failed device call in the daemon's own work: INTERNAL, "CUDA: <what>: <text>".
inline absl::Status CudaStatus(const kernels::Error& error, absl::string_view what) {
  return KernelStatus(error, absl::StatusCode::kInternal, absl::StrCat("CUDA: ", what));
}

}  // namespace kvcd
