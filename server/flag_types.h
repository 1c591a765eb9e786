// Flag value types with the spellings operators type: byte sizes with unit suffixes and durations
// where a bare number means seconds. One parser each, shared by attnd's and attnctl's flags, so
// every byte-size and duration flag accepts the same forms and says the same thing when it cannot.
#ifndef ATTND_SERVER_FLAG_TYPES_H_
#define ATTND_SERVER_FLAG_TYPES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attnd {

// Bytes: an integer or decimal number with an optional unit, case-insensitive, optional "B":
//   K, M, G, T (or KB, MB, GB, TB) = powers of 1000; Ki, Mi, Gi, Ti (or KiB, ...) = powers of
//   1024 (Kubernetes' convention). "1Gi" = 1073741824, "1.5G" = 1500000000, "4096" = 4096 bytes.
// INVALID_ARGUMENT saying which forms are expected for anything else, a negative number, a
// fraction of a byte, or more than 2^63-1 bytes.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);
// The shortest exact spelling: "512Mi", "4Gi", "1500000000" (no suffix when none divides it).
std::string FormatByteSize(int64_t bytes);

// A duration: Abseil's syntax ("30s", "500ms", "1m30s", "1h", "inf") or a bare number, meaning
// seconds ("30", "0.5"). INVALID_ARGUMENT saying which forms are expected otherwise.
absl::StatusOr<absl::Duration> ParseFlexDuration(absl::string_view text);

// Flag types (ABSL_FLAG(attnd::ByteSize, ...)) using the parsers above.
struct ByteSize {
  int64_t bytes = 0;
};
bool AbslParseFlag(absl::string_view text, ByteSize* out, std::string* error);
std::string AbslUnparseFlag(ByteSize value);

struct FlexDuration {
  absl::Duration value;
};
bool AbslParseFlag(absl::string_view text, FlexDuration* out, std::string* error);
std::string AbslUnparseFlag(FlexDuration value);

}  // namespace attnd

#endif  // ATTND_SERVER_FLAG_TYPES_H_
