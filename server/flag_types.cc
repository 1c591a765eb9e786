#include "server/flag_types.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace attnd {
namespace {

constexpr char kByteForms[] =
    "expected a byte count: a number with an optional unit K, M, G, T (powers of 1000) or Ki, "
    "Mi, Gi, Ti (powers of 1024), e.g. 4096, 512Mi, 4Gi, 1.5G";

struct Unit {
  const char* name;  // lowercase, without the optional trailing "b"
  int64_t factor;
};
constexpr Unit kUnits[] = {
    {"", 1},
    {"k", 1000},
    {"m", 1000 * 1000},
    {"g", 1000ll * 1000 * 1000},
    {"t", 1000ll * 1000 * 1000 * 1000},
    {"ki", 1ll << 10},
    {"mi", 1ll << 20},
    {"gi", 1ll << 30},
    {"ti", 1ll << 40},
};

}  // namespace

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  const absl::string_view original = text;
  text = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
    ++digits;
  }
  const absl::string_view number = text.substr(0, digits);
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text.substr(digits)));
  if (!unit.empty() && unit.back() == 'b') unit.pop_back();
  const Unit* found = nullptr;
  for (const Unit& u : kUnits) {
    if (unit == u.name) found = &u;
  }
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", original, "\": ", why, why.empty() ? "" : "; ", kByteForms));
  };
  if (!text.empty() && text[0] == '-') return bad("must not be negative");
  if (number.empty() || found == nullptr) return bad("");
  if (number.find('.') == absl::string_view::npos) {
    uint64_t n = 0;
    if (!absl::SimpleAtoi(number, &n)) return bad("");
    if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max() / found->factor)) {
      return bad("more than 2^63-1 bytes");
    }
    return static_cast<int64_t>(n) * found->factor;
  }
  double x = 0;
  if (!absl::SimpleAtod(number, &x) || !std::isfinite(x)) return bad("");
  const long double bytes = static_cast<long double>(x) * found->factor;
  if (bytes >= 9.2e18L) return bad("more than 2^63-1 bytes");
  if (bytes != std::floor(bytes)) return bad("not a whole number of bytes");
  return static_cast<int64_t>(bytes);
}

std::string FormatByteSize(int64_t bytes) {
  if (bytes == 0) return "0";
  for (const char* suffix : {"Ti", "Gi", "Mi", "Ki"}) {
    const int shift = suffix[0] == 'T' ? 40 : suffix[0] == 'G' ? 30 : suffix[0] == 'M' ? 20 : 10;
    if (bytes % (1ll << shift) == 0) return absl::StrCat(bytes >> shift, suffix);
  }
  return absl::StrCat(bytes);
}

absl::StatusOr<absl::Duration> ParseFlexDuration(absl::string_view text) {
  const absl::string_view t = absl::StripAsciiWhitespace(text);
  double seconds = 0;
  if (!t.empty() && (std::isdigit(static_cast<unsigned char>(t.back())) || t.back() == '.') &&
      absl::SimpleAtod(t, &seconds) && std::isfinite(seconds)) {
    return absl::Seconds(seconds);
  }
  absl::Duration d;
  if (absl::ParseDuration(t, &d)) return d;
  return absl::InvalidArgumentError(
      absl::StrCat("\"", text,
                   "\": expected a duration: a number of seconds (30, 0.5) or a number with a unit "
                   "ns, us, ms, s, m, h (500ms, 30s, 1m30s, 2h)"));
}

bool AbslParseFlag(absl::string_view text, ByteSize* out, std::string* error) {
  absl::StatusOr<int64_t> bytes = ParseByteSize(text);
  if (!bytes.ok()) {
    *error = std::string(bytes.status().message());
    return false;
  }
  out->bytes = *bytes;
  return true;
}

std::string AbslUnparseFlag(ByteSize value) { return FormatByteSize(value.bytes); }

bool AbslParseFlag(absl::string_view text, FlexDuration* out, std::string* error) {
  absl::StatusOr<absl::Duration> d = ParseFlexDuration(text);
  if (!d.ok()) {
    *error = std::string(d.status().message());
    return false;
  }
  out->value = *d;
  return true;
}

std::string AbslUnparseFlag(FlexDuration value) { return absl::FormatDuration(value.value); }

}  // namespace attnd
