#include "server/rpc/metrics.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace attnd {
namespace {

using Key = std::vector<std::string>;

Key MakeKey(LabelValues labels) { return Key(labels.begin(), labels.end()); }

// Shortest decimal that parses back to the same double; Prometheus spellings for the specials.
std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {  // 2^53: exact integers
    return absl::StrCat(static_cast<int64_t>(v));
  }
  char buf[40];
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// Label values: backslash, double quote and line feed are escaped.
std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// HELP text: backslash and line feed are escaped (quotes are not).
std::string EscapeHelp(absl::string_view help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"}` (or "" with no labels); `extra` is appended last (histograms' le).
std::string RenderLabels(const std::vector<std::string>& names, const Key& values,
                         absl::string_view extra_name = "", absl::string_view extra_value = "") {
  if (names.empty() && extra_name.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, names[i], "=\"", EscapeLabelValue(values[i]), "\"");
  }
  if (!extra_name.empty()) {
    if (!names.empty()) out += ',';
    absl::StrAppend(&out, extra_name, "=\"", EscapeLabelValue(extra_value), "\"");
  }
  out += '}';
  return out;
}

template <typename Map>
std::vector<typename Map::const_pointer> SortedSeries(const Map& map) {
  std::vector<typename Map::const_pointer> series;
  series.reserve(map.size());
  for (const auto& entry : map) series.push_back(&entry);
  std::sort(series.begin(), series.end(), [](auto a, auto b) { return a->first < b->first; });
  return series;
}

bool IsValidMetricName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok =
        absl::ascii_isalpha(c) || c == '_' || c == ':' || (i > 0 && absl::ascii_isdigit(c));
    if (!ok) return false;
  }
  return true;
}

bool IsValidLabelName(absl::string_view name) {
  if (name.empty() || absl::StartsWith(name, "__")) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = absl::ascii_isalpha(c) || c == '_' || (i > 0 && absl::ascii_isdigit(c));
    if (!ok) return false;
  }
  return true;
}

}  // namespace

bool MetricFamily::CheckArity(LabelValues values) const {
  const bool ok = values.size() == label_names_.size();
  assert(ok && "label value count does not match the family's label names");
  return ok;
}

void MetricFamily::RenderHeader(absl::string_view type, std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n");
  absl::StrAppend(out, "# TYPE ", name_, " ", type, "\n");
}

// ---- Counter ----

void CounterFamily::Increment(LabelValues labels, double delta) {
  if (!CheckArity(labels) || !(delta >= 0)) return;
  Key key = MakeKey(labels);
  MutexLock lock(&mu_);
  values_[std::move(key)] += delta;
}

double CounterFamily::Value(LabelValues labels) const {
  if (!CheckArity(labels)) return 0;
  MutexLock lock(&mu_);
  auto it = values_.find(MakeKey(labels));
  return it == values_.end() ? 0 : it->second;
}

void CounterFamily::Render(std::string* out) const {
  RenderHeader("counter", out);
  MutexLock lock(&mu_);
  // A family without labels shows 0 before its first increment, so rate() has a starting point.
  if (label_names_.empty() && values_.empty()) absl::StrAppend(out, name_, " 0\n");
  for (const auto* entry : SortedSeries(values_)) {
    absl::StrAppend(out, name_, RenderLabels(label_names_, entry->first), " ",
                    FormatValue(entry->second), "\n");
  }
}

// ---- Gauge ----

void GaugeFamily::Set(LabelValues labels, double value) {
  if (!CheckArity(labels)) return;
  Key key = MakeKey(labels);
  MutexLock lock(&mu_);
  values_[std::move(key)] = value;
}

void GaugeFamily::Add(LabelValues labels, double delta) {
  if (!CheckArity(labels)) return;
  Key key = MakeKey(labels);
  MutexLock lock(&mu_);
  values_[std::move(key)] += delta;
}

double GaugeFamily::Value(LabelValues labels) const {
  if (!CheckArity(labels)) return 0;
  MutexLock lock(&mu_);
  auto it = values_.find(MakeKey(labels));
  return it == values_.end() ? 0 : it->second;
}

void GaugeFamily::Render(std::string* out) const {
  RenderHeader("gauge", out);
  MutexLock lock(&mu_);
  if (label_names_.empty() && values_.empty()) absl::StrAppend(out, name_, " 0\n");
  for (const auto* entry : SortedSeries(values_)) {
    absl::StrAppend(out, name_, RenderLabels(label_names_, entry->first), " ",
                    FormatValue(entry->second), "\n");
  }
}

// ---- Histogram ----

void HistogramFamily::Observe(LabelValues labels, double value) {
  if (!CheckArity(labels) || std::isnan(value)) return;
  // First bound >= value (le semantics); past the last bound is the +Inf bucket.
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  Key key = MakeKey(labels);
  MutexLock lock(&mu_);
  Snapshot& s = series_[std::move(key)];
  if (s.bucket_counts.empty()) s.bucket_counts.assign(bounds_.size() + 1, 0);
  ++s.bucket_counts[bucket];
  s.sum += value;
  ++s.count;
}

HistogramFamily::Snapshot HistogramFamily::Get(LabelValues labels) const {
  Snapshot empty;
  empty.bucket_counts.assign(bounds_.size() + 1, 0);
  if (!CheckArity(labels)) return empty;
  MutexLock lock(&mu_);
  auto it = series_.find(MakeKey(labels));
  return it == series_.end() ? empty : it->second;
}

void HistogramFamily::Render(std::string* out) const {
  RenderHeader("histogram", out);
  auto render_one = [&](const Key& key, const Snapshot& s) {
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= bounds_.size(); ++i) {
      cumulative += s.bucket_counts.empty() ? 0 : s.bucket_counts[i];
      const std::string le = i < bounds_.size() ? FormatValue(bounds_[i]) : "+Inf";
      absl::StrAppend(out, name_, "_bucket", RenderLabels(label_names_, key, "le", le), " ",
                      cumulative, "\n");
    }
    absl::StrAppend(out, name_, "_sum", RenderLabels(label_names_, key), " ", FormatValue(s.sum),
                    "\n");
    absl::StrAppend(out, name_, "_count", RenderLabels(label_names_, key), " ", s.count, "\n");
  };
  MutexLock lock(&mu_);
  if (label_names_.empty() && series_.empty()) render_one(Key(), Snapshot());
  for (const auto* entry : SortedSeries(series_)) render_one(entry->first, entry->second);
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) bounds.push_back(v);
  return bounds;
}

std::vector<double> LatencySecondsBuckets() { return ExponentialBuckets(0.0001, 2, 21); }

// ---- Registry ----

absl::Status MetricsRegistry::CheckNewFamily(absl::string_view name,
                                             const std::vector<std::string>& labels) {
  if (!IsValidMetricName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid metric name '", name, "'"));
  }
  for (const auto& family : families_) {
    if (family->name() == name) {
      return absl::InvalidArgumentError(absl::StrCat("metric '", name, "' registered twice"));
    }
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    if (!IsValidLabelName(labels[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric '", name, "': invalid label name '", labels[i], "'"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (labels[i] == labels[j]) {
        return absl::InvalidArgumentError(
            absl::StrCat("metric '", name, "': label '", labels[i], "' repeated"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CounterFamily*> MetricsRegistry::AddCounter(std::string name, std::string help,
                                                           std::vector<std::string> label_names) {
  MutexLock lock(&mu_);
  ATTND_RETURN_IF_ERROR(CheckNewFamily(name, label_names));
  auto family =
      std::make_unique<CounterFamily>(std::move(name), std::move(help), std::move(label_names));
  CounterFamily* raw = family.get();
  families_.push_back(std::move(family));
  return raw;
}

absl::StatusOr<GaugeFamily*> MetricsRegistry::AddGauge(std::string name, std::string help,
                                                       std::vector<std::string> label_names) {
  MutexLock lock(&mu_);
  ATTND_RETURN_IF_ERROR(CheckNewFamily(name, label_names));
  auto family =
      std::make_unique<GaugeFamily>(std::move(name), std::move(help), std::move(label_names));
  GaugeFamily* raw = family.get();
  families_.push_back(std::move(family));
  return raw;
}

absl::StatusOr<HistogramFamily*> MetricsRegistry::AddHistogram(std::string name, std::string help,
                                                               std::vector<std::string> label_names,
                                                               std::vector<double> bounds) {
  MutexLock lock(&mu_);
  ATTND_RETURN_IF_ERROR(CheckNewFamily(name, label_names));
  if (std::find(label_names.begin(), label_names.end(), "le") != label_names.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("histogram '", name, "': 'le' is reserved for buckets"));
  }
  if (bounds.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("histogram '", name, "': no buckets"));
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram '", name, "': bucket bounds must be finite and strictly increasing"));
    }
  }
  auto family = std::make_unique<HistogramFamily>(std::move(name), std::move(help),
                                                  std::move(label_names), std::move(bounds));
  HistogramFamily* raw = family.get();
  families_.push_back(std::move(family));
  return raw;
}

void MetricsRegistry::AddCollectHook(std::function<void()> hook) {
  MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::string MetricsRegistry::RenderPrometheusText() const {
  std::vector<std::function<void()>> hooks;
  std::vector<const MetricFamily*> families;
  {
    MutexLock lock(&mu_);
    hooks = hooks_;
    for (const auto& family : families_) families.push_back(family.get());
  }
  // Hooks run without the registry lock: they record into families, which lock themselves.
  for (const auto& hook : hooks) hook();
  std::string out;
  for (const MetricFamily* family : families) family->Render(&out);
  return out;
}

// ---- AttndMetrics ----

absl::StatusOr<std::unique_ptr<AttndMetrics>> AttndMetrics::Create(const BuildInfo& build) {
  std::unique_ptr<AttndMetrics> m(new AttndMetrics());
  MetricsRegistry& r = m->registry_;
  const std::vector<double> latency = LatencySecondsBuckets();
  ATTND_ASSIGN_OR_RETURN(
      m->requests_total,
      r.AddCounter("attnd_requests_total", "Finished RPCs by method and gRPC status code.",
                   {"rpc", "code"}));
  ATTND_ASSIGN_OR_RETURN(
      m->request_failures_total,
      r.AddCounter("attnd_request_failures_total",
                   "Finished RPCs whose status was not OK, by method and gRPC status code.",
                   {"rpc", "code"}));
  ATTND_ASSIGN_OR_RETURN(
      m->queue_seconds,
      r.AddHistogram("attnd_request_queue_seconds",
                     "Time from accepting an RPC to a worker starting it.", {"rpc"}, latency));
  ATTND_ASSIGN_OR_RETURN(
      m->compute_seconds,
      r.AddHistogram("attnd_request_compute_seconds",
                     "Time a worker spent running an RPC (validation, paging, kernels).", {"rpc"},
                     latency));
  ATTND_ASSIGN_OR_RETURN(
      m->request_seconds,
      r.AddHistogram("attnd_request_duration_seconds",
                     "Time from the handler receiving an RPC to its reply.", {"rpc"}, latency));
  ATTND_ASSIGN_OR_RETURN(
      m->decode_batch_size,
      r.AddHistogram("attnd_decode_batch_size", "Sequences per executed decode batch.", {},
                     ExponentialBuckets(1, 2, 9)));
  ATTND_ASSIGN_OR_RETURN(m->graph_replays_total,
                         r.AddCounter("attnd_cuda_graph_replays_total",
                                      "Decode batches run by replaying a CUDA graph."));
  ATTND_ASSIGN_OR_RETURN(m->kv_pages_used,
                         r.AddGauge("attnd_kv_pages_used", "KV cache pages held by sequences."));
  ATTND_ASSIGN_OR_RETURN(m->kv_pages_free,
                         r.AddGauge("attnd_kv_pages_free", "KV cache pages free to allocate."));
  ATTND_ASSIGN_OR_RETURN(
      m->kv_capacity_tokens,
      r.AddGauge("attnd_kv_capacity_tokens",
                 "Tokens the KV pool holds (pages x page size; per layer), labelled with the KV "
                 "dtype (fp32, bf16, fp8_e4m3, int8: the one-byte dtypes hold about twice bf16's "
                 "tokens).",
                 {"kv_dtype"}));
  ATTND_ASSIGN_OR_RETURN(
      m->kv_shard_pool_bytes,
      r.AddGauge(
          "attnd_kv_shard_pool_bytes",
          "KV pool bytes of each engine shard on its device (EngineOptions::devices / shards).",
          {"shard", "device"}));
  ATTND_ASSIGN_OR_RETURN(m->kv_shard_bytes_used,
                         r.AddGauge("attnd_kv_shard_bytes_used",
                                    "Of each shard's KV pool, bytes in pages held by sequences.",
                                    {"shard", "device"}));
  ATTND_ASSIGN_OR_RETURN(m->live_sequences,
                         r.AddGauge("attnd_live_sequences", "Sequences created and not released."));
  ATTND_ASSIGN_OR_RETURN(m->open_fds, r.AddGauge("attnd_open_fds",
                                                 "File descriptors open now (one per client "
                                                 "connection, plus attnd's own)."));
  ATTND_ASSIGN_OR_RETURN(
      m->fd_limit,
      r.AddGauge("attnd_fd_limit", "The soft RLIMIT_NOFILE attnd runs with; -1 = none."));
  ATTND_ASSIGN_OR_RETURN(
      m->accepting,
      r.AddGauge("attnd_api_accepting",
                 "1 while the API listener accepts connections; 0 once accept4 failed (gRPC 1.51 "
                 "does not resume: restart)."));
  ATTND_ASSIGN_OR_RETURN(
      m->connections_open,
      r.AddGauge("attnd_connections_open",
                 "Connections open on a plaintext listener (waiting for the HTTP/2 preface, or "
                 "served); ServerOptions::max_connections caps the API's.",
                 {"listener"}));
  ATTND_ASSIGN_OR_RETURN(
      m->connections_closed_total,
      r.AddCounter("attnd_connections_closed_total",
                   "Connections a plaintext listener closed before serving them: preface_timeout, "
                   "bad_preface, shed_pending (the oldest silent one, at the cap), refused_at_cap, "
                   "refused_no_fds (out of file descriptors).",
                   {"listener", "reason"}));
  ATTND_ASSIGN_OR_RETURN(m->inflight_request_bytes,
                         r.AddGauge("attnd_inflight_request_bytes",
                                    "Bytes of requests being served now "
                                    "(ServerOptions::max_inflight_request_bytes bounds it)."));
  ATTND_ASSIGN_OR_RETURN(m->bytes_received_total,
                         r.AddCounter("attnd_received_bytes_total",
                                      "Request message bytes received, by method.", {"rpc"}));
  ATTND_ASSIGN_OR_RETURN(
      m->bytes_sent_total,
      r.AddCounter("attnd_sent_bytes_total", "Response message bytes sent, by method.", {"rpc"}));
  ATTND_ASSIGN_OR_RETURN(
      m->build_info,
      r.AddGauge("attnd_build_info", "Always 1; the labels describe the running build.",
                 {"version", "revision", "backend", "model"}));
  ATTND_ASSIGN_OR_RETURN(
      m->idle_reclaimed_total,
      r.AddCounter("attnd_sequences_idle_reclaimed_total",
                   "Sequences released by the server because they were idle too long."));
  ATTND_ASSIGN_OR_RETURN(
      m->device_steps_total,
      r.AddCounter("attnd_device_steps_total",
                   "Device steps run, by work: decode batches and prefill steps (a prefill call "
                   "runs as one or more bounded steps).",
                   {"work"}));
  ATTND_ASSIGN_OR_RETURN(
      m->device_turn_waits_total,
      r.AddCounter("attnd_device_turn_waits_total",
                   "Device steps that waited for a step of the other kind to end, by work.",
                   {"work"}));
  ATTND_ASSIGN_OR_RETURN(
      m->device_turn_wait_seconds_total,
      r.AddCounter("attnd_device_turn_wait_seconds_total",
                   "Time device steps spent waiting for their turn, by work.", {"work"}));
  ATTND_ASSIGN_OR_RETURN(
      m->prefill_owed_turns_total,
      r.AddCounter("attnd_prefill_owed_turns_total",
                   "Prefill steps admitted while decodes waited, because prefill was below its "
                   "guaranteed share (--prefill-share)."));
  ATTND_ASSIGN_OR_RETURN(
      m->auth_failures_total,
      r.AddCounter("attnd_auth_failures_total",
                   "RPCs rejected as UNAUTHENTICATED, by reason (missing, malformed, invalid).",
                   {"reason"}));
  m->build_info->Set({build.version, build.revision, build.backend, build.model}, 1);
  return m;
}

void AttndMetrics::ObserveDecodeBatch(int64_t entries, const DecodeStats& ran) {
  decode_batch_size->Observe({}, static_cast<double>(entries));
  if (ran.graph_replays > 0) graph_replays_total->Increment({});
}

void AttndMetrics::RecordRequest(absl::string_view rpc, absl::string_view code, double queue_s,
                                 double compute_s, double total_s, int64_t bytes_received,
                                 int64_t bytes_sent) {
  requests_total->Increment({rpc, code});
  if (code != "OK") request_failures_total->Increment({rpc, code});
  if (queue_s >= 0) queue_seconds->Observe({rpc}, queue_s);
  if (compute_s >= 0) compute_seconds->Observe({rpc}, compute_s);
  if (total_s >= 0) request_seconds->Observe({rpc}, total_s);
  if (bytes_received > 0) bytes_received_total->Increment({rpc}, bytes_received);
  if (bytes_sent > 0) bytes_sent_total->Increment({rpc}, bytes_sent);
}

absl::string_view StatusCodeName(int code) {
  static constexpr absl::string_view kNames[] = {"OK",
                                                 "CANCELLED",
                                                 "UNKNOWN",
                                                 "INVALID_ARGUMENT",
                                                 "DEADLINE_EXCEEDED",
                                                 "NOT_FOUND",
                                                 "ALREADY_EXISTS",
                                                 "PERMISSION_DENIED",
                                                 "RESOURCE_EXHAUSTED",
                                                 "FAILED_PRECONDITION",
                                                 "ABORTED",
                                                 "OUT_OF_RANGE",
                                                 "UNIMPLEMENTED",
                                                 "INTERNAL",
                                                 "UNAVAILABLE",
                                                 "DATA_LOSS",
                                                 "UNAUTHENTICATED"};
  if (code < 0 || code >= static_cast<int>(std::size(kNames))) return "UNKNOWN";
  return kNames[code];
}

}  // namespace attnd
