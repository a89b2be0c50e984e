// Status propagation helpers (absl 20220623 ships none).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVCD_CONCAT_INNER(a, b) a##b
#define KVCD_CONCAT(a, b) KVCD_CONCAT_INNER(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define KVCD_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status kvcd_status_ = (expr);        \
    if (!kvcd_status_.ok()) return kvcd_status_; \
  } while (0)

// `lhs = value of expr` or return its error status.
#define KVCD_ASSIGN_OR_RETURN(lhs, expr) \
  KVCD_ASSIGN_OR_RETURN_IMPL(KVCD_CONCAT(kvcd_statusor_, __LINE__), lhs, expr)
#define KVCD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
