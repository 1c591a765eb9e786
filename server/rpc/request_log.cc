#include "server/rpc/request_log.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/rpc/metrics.h"

namespace attnd {

RequestLog::RequestLog(RequestLogOptions options, const Clock* clock,
                       std::function<void(const std::string&)> sink)
    : options_(options), clock_(clock), sink_(std::move(sink)) {}

std::string RequestLog::Format(const RequestLogEntry& e) {
  // 8 characters of the random part (never the whole capability), after a fleet member's
  // "<instance>." (at most a DNS label's 63 characters) so the line says which daemon's it is.
  const size_t dot = e.sequence_id.find('.');
  const size_t keep = dot != std::string::npos && dot >= 1 && dot <= 63 ? dot + 1 + 8 : 8;
  // Both are the client's words (an id is logged before it is checked): escaped, so that no
  // newline, ESC or NUL of theirs reaches the log and a line cannot be forged.
  std::string line = absl::StrCat(
      "request method=", e.method, " tenant=", e.tenant.empty() ? "-" : absl::CHexEscape(e.tenant),
      " seq=", e.sequence_id.empty() ? "-" : absl::CHexEscape(e.sequence_id.substr(0, keep)));
  if (e.tokens >= 0) absl::StrAppend(&line, " tokens=", e.tokens);
  absl::StrAppend(&line, " code=", StatusCodeName(e.code));
  if (e.latency_us >= 0) absl::StrAppend(&line, " latency_us=", e.latency_us);
  return line;
}

void RequestLog::Log(const RequestLogEntry& entry) {
  std::string suppressed_line;
  {
    MutexLock lock(&mu_);
    if (entry.code == 0) {
      if (options_.sample <= 0) return;
      if (ok_seen_++ % options_.sample != 0) return;
    }
    if (options_.max_lines_per_second > 0) {
      const int64_t second = absl::ToUnixSeconds(clock_->Now());
      if (second != window_second_) {
        window_second_ = second;
        window_lines_ = 0;
      }
      if (window_lines_ >= options_.max_lines_per_second) {
        ++suppressed_;
        return;
      }
      ++window_lines_;
      if (suppressed_ > 0) {
        suppressed_line = absl::StrCat("request log: suppressed ", suppressed_, " lines (cap ",
                                       options_.max_lines_per_second, " per second)");
        suppressed_ = 0;
      }
    }
  }
  if (!suppressed_line.empty()) sink_(suppressed_line);
  sink_(Format(entry));
}

}  // namespace attnd
