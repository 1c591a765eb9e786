// Runs a request's work so that no exception leaves it: an allocation that fails becomes
// RESOURCE_EXHAUSTED, anything else INTERNAL. attnd's code reports errors as absl::Status and
// throws nothing itself, but the standard library throws std::bad_alloc (and gRPC's and
// protobuf's allocations may too): uncaught on a worker or ring thread that is std::terminate,
// and on a gRPC thread a call that never finishes, with its budgets kept.
#ifndef ATTND_BASE_CATCH_ALL_H_
#define ATTND_BASE_CATCH_ALL_H_

#include <exception>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attnd {

// `what` names the work in the message ("the prefill").
template <typename Fn>
absl::Status CatchAll(absl::string_view what, Fn&& fn) {
  try {
    return std::forward<Fn>(fn)();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("attnd ran out of memory serving ", what,
                                                     "; nothing was changed: retry later"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, " failed: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, " failed with an unknown exception"));
  }
}

}  // namespace attnd

#endif  // ATTND_BASE_CATCH_ALL_H_
