// Prometheus metrics for attnd: a small thread-safe registry of counter, gauge and histogram
// families rendered in the text exposition format 0.0.4, and `AttndMetrics`, the concrete families
// the daemon exports. Served over HTTP by server/rpc/metrics_http.h; the gRPC service records into
// AttndMetrics.
//
// Everything here is thread-safe: any thread may record while another renders. Recording takes one
// family mutex (a hash lookup by label values); series are never removed, so label values must come
// from small fixed sets (RPC names, status codes), never from request data such as sequence ids.
#ifndef ATTND_SERVER_RPC_METRICS_H_
#define ATTND_SERVER_RPC_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "server/engine/engine.h"

namespace attnd {

// Label values of one series, in the order of the family's label names.
using LabelValues = absl::Span<const absl::string_view>;

// What every family shares: name, help, label names, rendering.
class MetricFamily {
 public:
  virtual ~MetricFamily() = default;
  const std::string& name() const { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // Appends "# HELP", "# TYPE" and one line per sample (series sorted by label values).
  virtual void Render(std::string* out) const = 0;

 protected:
  MetricFamily(std::string name, std::string help, std::vector<std::string> label_names)
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)) {}
  // Whether `values` has one value per label name. A mismatch is a programming error: the
  // observation is dropped (and asserts in debug builds) rather than corrupting the exposition.
  bool CheckArity(LabelValues values) const;
  void RenderHeader(absl::string_view type, std::string* out) const;

  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
};

// A monotonically increasing value per label set (`_total` names by convention).
class CounterFamily final : public MetricFamily {
 public:
  CounterFamily(std::string name, std::string help, std::vector<std::string> label_names)
      : MetricFamily(std::move(name), std::move(help), std::move(label_names)) {}
  // `delta` must be >= 0; negative or NaN deltas are ignored (a counter never goes down).
  void Increment(LabelValues labels, double delta = 1);
  double Value(LabelValues labels) const;  // 0 for a series never recorded
  void Render(std::string* out) const override;

 private:
  mutable Mutex mu_;
  absl::flat_hash_map<std::vector<std::string>, double> values_ ABSL_GUARDED_BY(mu_);
};

// A value that goes up and down per label set.
class GaugeFamily final : public MetricFamily {
 public:
  GaugeFamily(std::string name, std::string help, std::vector<std::string> label_names)
      : MetricFamily(std::move(name), std::move(help), std::move(label_names)) {}
  void Set(LabelValues labels, double value);
  void Add(LabelValues labels, double delta);
  double Value(LabelValues labels) const;
  void Render(std::string* out) const override;

 private:
  mutable Mutex mu_;
  absl::flat_hash_map<std::vector<std::string>, double> values_ ABSL_GUARDED_BY(mu_);
};

// Observations counted into fixed buckets per label set: renders cumulative `_bucket{le=...}`
// (ending with le="+Inf"), `_sum` and `_count`.
class HistogramFamily final : public MetricFamily {
 public:
  struct Snapshot {
    std::vector<uint64_t> bucket_counts;  // non-cumulative; one per bound plus the +Inf bucket
    double sum = 0;
    uint64_t count = 0;
  };

  // `bounds`: finite, strictly increasing upper bounds (the +Inf bucket is implicit).
  HistogramFamily(std::string name, std::string help, std::vector<std::string> label_names,
                  std::vector<double> bounds)
      : MetricFamily(std::move(name), std::move(help), std::move(label_names)),
        bounds_(std::move(bounds)) {}
  // NaN observations are ignored. A value equal to a bound falls in that bound's bucket (le).
  void Observe(LabelValues labels, double value);
  Snapshot Get(LabelValues labels) const;  // empty counts for a series never recorded
  const std::vector<double>& bounds() const { return bounds_; }
  void Render(std::string* out) const override;

 private:
  const std::vector<double> bounds_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::vector<std::string>, Snapshot> series_ ABSL_GUARDED_BY(mu_);
};

// Bucket helpers. ExponentialBuckets(1, 2, 4) = {1, 2, 4, 8}.
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// 100 µs .. ~105 s, x2 steps: wide enough for a CPU prefill of a long prompt and a GPU decode.
std::vector<double> LatencySecondsBuckets();

// Owns the families; renders them all. Registration validates names (metric names
// [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]* not starting with "__", no "le"
// label on histograms, unique family names, valid bounds) and returns INVALID_ARGUMENT otherwise.
// Returned pointers live as long as the registry.
class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  absl::StatusOr<CounterFamily*> AddCounter(std::string name, std::string help,
                                            std::vector<std::string> label_names = {});
  absl::StatusOr<GaugeFamily*> AddGauge(std::string name, std::string help,
                                        std::vector<std::string> label_names = {});
  absl::StatusOr<HistogramFamily*> AddHistogram(std::string name, std::string help,
                                                std::vector<std::string> label_names,
                                                std::vector<double> bounds);

  // `hook` runs at the start of every render, before any family is read: the place to sample
  // values owned elsewhere (free pages, live sequences) into gauges. Hooks must not render.
  void AddCollectHook(std::function<void()> hook);

  // The whole registry in Prometheus text format 0.0.4, families in registration order.
  std::string RenderPrometheusText() const;

 private:
  absl::Status CheckNewFamily(absl::string_view name, const std::vector<std::string>& labels)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  std::vector<std::unique_ptr<MetricFamily>> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

// The content type to serve RenderPrometheusText() with.
inline constexpr char kPrometheusContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Values for attnd_build_info's labels.
struct BuildInfo {
  std::string version;   // e.g. "0.1.0"
  std::string revision;  // git commit, "" if unknown
  std::string backend;   // "cpu" | "cuda"
  std::string model;     // the served model's name
};

// The families attnd exports. Label names:
//   rpc:    the RPC method name, e.g. "Prefill", "Decode", "CreateSequence"
//   code:   the gRPC status code name, e.g. "OK", "NOT_FOUND" (see StatusCodeName)
//   reason: auth failure reason: "missing", "malformed", "invalid"
class AttndMetrics {
 public:
  static absl::StatusOr<std::unique_ptr<AttndMetrics>> Create(const BuildInfo& build);

  MetricsRegistry& registry() { return registry_; }

  // One finished RPC: counts it (and a failure when code != "OK"), observes the three latencies
  // (queue: accepted -> a worker started it; compute: the worker's time; total: handler entry ->
  // reply; pass a negative value to skip one, e.g. queue/compute for an RPC rejected up front),
  // and adds the request/response message sizes.
  // One executed decode batch of `entries` entries (from the batcher or, without it, one Decode
  // request): the batch-size histogram and the graph-replay counter.
  void ObserveDecodeBatch(int64_t entries, const DecodeStats& ran);

  void RecordRequest(absl::string_view rpc, absl::string_view code, double queue_s,
                     double compute_s, double total_s, int64_t bytes_received, int64_t bytes_sent);

  CounterFamily* requests_total;            // {rpc, code}
  CounterFamily* request_failures_total;    // {rpc, code}; code != OK
  HistogramFamily* queue_seconds;           // {rpc}
  HistogramFamily* compute_seconds;         // {rpc}
  HistogramFamily* request_seconds;         // {rpc}
  HistogramFamily* decode_batch_size;       // {}; sequences per executed decode batch
  CounterFamily* graph_replays_total;       // {}; CUDA graph launches (decode)
  GaugeFamily* kv_pages_used;               // {}
  GaugeFamily* kv_pages_free;               // {}
  GaugeFamily* kv_capacity_tokens;          // {kv_dtype}; tokens the pool holds (pages x size)
  GaugeFamily* kv_shard_pool_bytes;         // {shard, device}; each shard's K/V memory
  GaugeFamily* kv_shard_bytes_used;         // {shard, device}; of it, held by sequences' pages
  GaugeFamily* live_sequences;              // {}
  GaugeFamily* open_fds;                    // {}; file descriptors open now
  GaugeFamily* fd_limit;                    // {}; the soft RLIMIT_NOFILE (-1: unlimited)
  GaugeFamily* accepting;                   // {}; 1 while the API listener accepts connections
  GaugeFamily* connections_open;            // {listener}; attnd's own listeners (listener.h)
  CounterFamily* connections_closed_total;  // {listener, reason}; closed by attnd's listeners
  GaugeFamily* inflight_request_bytes;      // {}; request bytes being served
  CounterFamily* bytes_received_total;      // {rpc}; request message bytes
  CounterFamily* bytes_sent_total;          // {rpc}; response message bytes
  GaugeFamily* build_info;                  // {version, revision, backend, model}; always 1
  CounterFamily* idle_reclaimed_total;      // {}; sequences released by the idle timeout
  // The step scheduler (server/sched/step_scheduler.h), work: "decode" | "prefill".
  CounterFamily* device_steps_total;              // {work}; decode batches, prefill steps
  CounterFamily* device_turn_waits_total;         // {work}; steps that waited for the other kind
  CounterFamily* device_turn_wait_seconds_total;  // {work}; how long they waited
  CounterFamily* prefill_owed_turns_total;        // {}; prefill steps run ahead of waiting decodes
  CounterFamily* auth_failures_total;             // {reason}

 private:
  AttndMetrics() = default;
  MetricsRegistry registry_;
};

// "OK", "CANCELLED", ... "UNAUTHENTICATED" for google.rpc codes 0..16; "UNKNOWN" otherwise.
absl::string_view StatusCodeName(int code);

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_METRICS_H_
