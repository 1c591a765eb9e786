// Local Status propagation macros: Debian's abseil 20220623 has no RETURN_IF_ERROR /
// ASSIGN_OR_RETURN.
#ifndef ATTND_BASE_STATUS_MACROS_H_
#define ATTND_BASE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTND_CONCAT_INNER_(a, b) a##b
#define ATTND_CONCAT_(a, b) ATTND_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define ATTND_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status attnd_status_ = (expr);         \
    if (!attnd_status_.ok()) return attnd_status_; \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error status.
#define ATTND_ASSIGN_OR_RETURN(lhs, expr) \
  ATTND_ASSIGN_OR_RETURN_IMPL_(ATTND_CONCAT_(attnd_statusor_, __LINE__), lhs, expr)
#define ATTND_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

#endif  // ATTND_BASE_STATUS_MACROS_H_
