// The request log: one structured line per RPC (method, tenant, sequence id prefix, tokens, status
// code, latency), sampled and rate limited so that a busy server does not log thousands of lines a
// second:
//   - OK requests: one in `sample` (the first, then every sample-th); 0 = none, 1 = all.
//   - errors: every one.
//   - at most `max_lines_per_second` lines (OK and errors together) per wall-clock second; what the
//     cap drops is counted and reported on the next line that gets through, as its own line
//     "request log: suppressed N lines (cap M per second)".
// Lines look like
//   request method=Prefill tenant=team-a seq=3f9c01ab tokens=512 code=OK latency_us=8123
// (tenant "-" when tokens are off, seq "-" when the RPC names none). Thread-safe.
#ifndef ATTND_SERVER_RPC_REQUEST_LOG_H_
#define ATTND_SERVER_RPC_REQUEST_LOG_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"
#include "base/clock.h"
#include "base/mutex.h"

namespace attnd {

struct RequestLogOptions {
  int64_t sample = 1000;              // one in N OK requests; 0 = no OK request
  int64_t max_lines_per_second = 50;  // 0 = no cap
};

struct RequestLogEntry {
  absl::string_view method;
  absl::string_view tenant;
  absl::string_view sequence_id;  // the first 8 characters are logged
  int64_t tokens = -1;            // -1: the RPC carries none
  int code = 0;                   // google.rpc code
  int64_t latency_us = -1;        // -1: not known
};

class RequestLog {
 public:
  // `sink` gets each line (attnd: spdlog::info); `clock` must outlive the log.
  RequestLog(RequestLogOptions options, const Clock* clock,
             std::function<void(const std::string&)> sink);

  void Log(const RequestLogEntry& entry);

  // The line for `entry`, as Log writes it.
  static std::string Format(const RequestLogEntry& entry);

 private:
  const RequestLogOptions options_;
  const Clock* const clock_;
  const std::function<void(const std::string&)> sink_;
  Mutex mu_;
  int64_t ok_seen_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t window_second_ ABSL_GUARDED_BY(mu_) = INT64_MIN;
  int64_t window_lines_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_REQUEST_LOG_H_
