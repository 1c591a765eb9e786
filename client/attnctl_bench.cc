#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/attnctl.h"

namespace attnd {
namespace client {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

struct Row {
  int64_t context = 0;
  std::string skipped;  // why the context was not run, or ""
  double prefill_tokens_per_s = 0;
  double prefill_ms_per_call = 0;
  double decode_steps_per_s = 0;
  double decode_p50_ms = 0;
  double decode_p99_ms = 0;
};

// Random inputs are made once per size and reused: generating them is client work, and the
// server's arithmetic does not depend on the values.
class Inputs {
 public:
  Inputs(DType dtype, int32_t hq, int32_t hkv, int32_t d, uint64_t seed, v1::QLayout layout)
      : dtype_(dtype), hq_(hq), hkv_(hkv), d_(d), rng_(static_cast<uint32_t>(seed)),
        pre_rotary_(layout == v1::Q_LAYOUT_PRE_ROTARY) {}

  struct Prefill {
    HostTensor q, k, v;
  };
  const Prefill& ForPrefill(int64_t t) {
    auto it = prefill_.find(t);
    if (it != prefill_.end()) return it->second;
    const std::vector<int64_t> q_shape =
        pre_rotary_ ? std::vector<int64_t>{t, hq_, d_} : std::vector<int64_t>{t, 5, hq_, d_};
    const int64_t q_n = (pre_rotary_ ? 1 : 5) * t * hq_ * d_;
    Prefill p{HostTensor::FromFloats(dtype_, q_shape, Random(q_n)),
              HostTensor::FromFloats(dtype_, {t, hkv_, d_}, Random(t * hkv_ * d_)),
              HostTensor::FromFloats(dtype_, {t, hkv_, d_}, Random(t * hkv_ * d_))};
    return prefill_.emplace(t, std::move(p)).first->second;
  }
  DecodeInput ForDecode(const std::string& id) {
    if (decode_.q.data.empty()) {
      decode_.q = pre_rotary_ ? HostTensor::FromFloats(dtype_, {hq_, d_}, Random(hq_ * d_))
                              : HostTensor::FromFloats(dtype_, {3, hq_, d_}, Random(3 * hq_ * d_));
      decode_.q_layout = pre_rotary_ ? v1::Q_LAYOUT_PRE_ROTARY : v1::Q_LAYOUT_VARIANTS;
      decode_.k = HostTensor::FromFloats(dtype_, {hkv_, d_}, Random(hkv_ * d_));
      decode_.v = HostTensor::FromFloats(dtype_, {hkv_, d_}, Random(hkv_ * d_));
    }
    DecodeInput in = decode_;
    in.sequence_id = id;
    return in;
  }

 private:
  std::vector<float> Random(int64_t n) {
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  DType dtype_;
  int32_t hq_, hkv_, d_;
  std::mt19937 rng_;
  std::map<int64_t, Prefill> prefill_;
  DecodeInput decode_;
  bool pre_rotary_ = false;
};

}  // namespace

int RunBench(AttndClient& client, const BenchOptions& options, std::ostream& out,
             std::ostream& err) {
  absl::StatusOr<v1::GetServerInfoResponse> info = client.Info();
  if (!info.ok()) {
    err << "attnctl bench: GetServerInfo: " << info.status() << "\n";
    return 2;
  }
  const v1::ModelInfo& m = info->model();
  const int32_t layers = options.layers == 0 ? m.num_layers() : options.layers;
  if (layers < 1 || layers > m.num_layers()) {
    err << "attnctl bench: --layers " << options.layers << " is not in [1, " << m.num_layers()
        << "] (0 = all)\n";
    return 2;
  }
  if (options.batch < 1 || options.prefill_chunk < 1 || options.decode_steps < 0 ||
      options.contexts.empty()) {
    err << "attnctl bench: --batch and --prefill-chunk must be >= 1, --decode-steps >= 0, and "
           "--context must list at least one length\n";
    return 2;
  }
  const int64_t es = static_cast<int64_t>(ElementSize(options.dtype));
  const int64_t per_token =
      (int64_t{5} * m.num_q_heads() + 2 * m.num_kv_heads()) * m.head_dim() * es;
  const int64_t limit =
      std::min(info->limits().max_message_bytes(), client.options().max_message_bytes);
  const int64_t chunk_cap = std::max<int64_t>(1, (limit - (64 << 10)) * 9 / 10 / per_token);
  const int64_t chunk = std::min(options.prefill_chunk, chunk_cap);
  if (chunk < options.prefill_chunk) {
    err << "NOTE: --prefill-chunk " << options.prefill_chunk << " exceeds the message limit ("
        << limit << " bytes); using " << chunk << "\n";
  }
  out << "bench: " << m.name() << " on " << info->backend() << " (" << info->device() << "), "
      << layers << " of " << m.num_layers() << " layers, " << DTypeName(options.dtype) << ", batch "
      << options.batch << ", prefill chunk " << chunk << ", " << options.decode_steps
      << " decode steps\n";

  Inputs inputs(options.dtype, m.num_q_heads(), m.num_kv_heads(), m.head_dim(), options.seed,
                options.q_layout);
  std::vector<Row> rows;
  std::vector<std::string> live;  // created and not yet released
  auto release_all = [&]() -> bool {
    bool ok = true;
    for (const std::string& id : live) {
      absl::StatusOr<int64_t> freed = client.Release(id);
      if (!freed.ok()) {
        err << "\nattnctl bench: ReleaseSequence " << id << ": " << freed.status() << "\n";
        ok = false;
      }
    }
    live.clear();
    return ok;
  };
  auto progress = [&](const std::string& line) {
    if (!options.progress) return;
    err << "\r" << absl::StrFormat("%-78s", line.substr(0, 78)) << std::flush;
  };
  int rc = 0;

  for (int64_t context : options.contexts) {
    Row row;
    row.context = context;
    const int64_t length = context + options.decode_steps;
    const int64_t page = std::max(1, info->kv_cache().page_size());
    absl::StatusOr<v1::GetServerInfoResponse> now = client.Info();
    const int64_t pages_free = now.ok() ? now->kv_cache().pages_free() : 0;
    const int64_t pages_needed = options.batch * ((length + page - 1) / page);
    if (context < 1) {
      row.skipped = "context must be >= 1";
    } else if (info->limits().max_sequence_length() > 0 &&
               length > info->limits().max_sequence_length()) {
      row.skipped = absl::StrCat("context + decode steps > max sequence length ",
                                 info->limits().max_sequence_length());
    } else if (pages_needed > pages_free) {
      row.skipped = absl::StrCat("needs ", pages_needed, " KV pages, ", pages_free, " free");
    }
    if (!row.skipped.empty()) {
      rows.push_back(row);
      continue;
    }

    std::string failure;
    for (int32_t b = 0; b < options.batch && failure.empty(); ++b) {
      absl::StatusOr<std::string> id = client.CreateSequence();
      if (!id.ok()) {
        failure = absl::StrCat("CreateSequence: ", id.status().ToString());
      } else {
        live.push_back(*id);
      }
    }
    // Prefill: every sequence, chunk by chunk, each chunk through all layers (as a model runs).
    double prefill_ms = 0;
    int64_t prefill_calls = 0;
    for (size_t s = 0; s < live.size() && failure.empty(); ++s) {
      for (int64_t start = 0; start < context && failure.empty(); start += chunk) {
        const int64_t t = std::min(chunk, context - start);
        const Inputs::Prefill& in = inputs.ForPrefill(t);
        for (int32_t layer = 0; layer < layers && failure.empty(); ++layer) {
          progress(absl::StrFormat("[context %d] prefill seq %d/%d: %d/%d tokens, layer %d",
                                   context, s + 1, live.size(), start + t, context, layer));
          const Clock::time_point t0 = Clock::now();
          absl::StatusOr<PrefillResult> r =
              client.Prefill(live[s], layer, in.q, in.k, in.v, context, options.q_layout);
          prefill_ms += Ms(Clock::now() - t0);
          ++prefill_calls;
          if (!r.ok()) failure = absl::StrCat("Prefill: ", r.status().ToString());
        }
      }
    }
    // Decode: one step = one batched call per layer.
    std::vector<double> step_ms;
    for (int64_t step = 0; step < options.decode_steps && failure.empty(); ++step) {
      progress(absl::StrFormat("[context %d] decode step %d/%d", context, step + 1,
                               options.decode_steps));
      std::vector<DecodeInput> entries;
      for (const std::string& id : live) entries.push_back(inputs.ForDecode(id));
      const Clock::time_point t0 = Clock::now();
      for (int32_t layer = 0; layer < layers && failure.empty(); ++layer) {
        absl::StatusOr<std::vector<DecodeResult>> r = client.Decode(layer, entries);
        if (!r.ok()) failure = absl::StrCat("Decode: ", r.status().ToString());
      }
      step_ms.push_back(Ms(Clock::now() - t0));
    }
    progress("");
    if (options.progress) err << "\r";
    const bool released = release_all();
    if (!failure.empty()) {
      err << "attnctl bench: context " << context << ": " << failure << "\n";
      row.skipped = "failed: " + failure;
      rows.push_back(row);
      rc = 2;
      break;
    }
    if (!released) rc = 2;
    row.prefill_tokens_per_s = prefill_ms > 0 ? context * options.batch / (prefill_ms / 1000.0) : 0;
    row.prefill_ms_per_call = prefill_calls > 0 ? prefill_ms / prefill_calls : 0;
    double decode_total = 0;
    for (double ms : step_ms) decode_total += ms;
    row.decode_steps_per_s = decode_total > 0 ? step_ms.size() / (decode_total / 1000.0) : 0;
    row.decode_p50_ms = Percentile(step_ms, 0.50);
    row.decode_p99_ms = Percentile(step_ms, 0.99);
    rows.push_back(row);
  }
  release_all();

  // Prefill tokens/s counts prompt tokens through all `layers` layers; a decode step is one
  // token for each of the batch's sequences through all `layers` layers.
  out << absl::StrFormat("%9s  %15s  %15s  %14s  %18s  %18s\n", "context", "prefill tok/s",
                         "prefill ms/call", "decode steps/s", "decode ms/step p50",
                         "decode ms/step p99");
  for (const Row& r : rows) {
    if (!r.skipped.empty()) {
      out << absl::StrFormat("%9d  skipped: %s\n", r.context, r.skipped);
      continue;
    }
    out << absl::StrFormat("%9d  %15.1f  %15.2f  %14.2f  %18.2f  %18.2f\n", r.context,
                           r.prefill_tokens_per_s, r.prefill_ms_per_call, r.decode_steps_per_s,
                           r.decode_p50_ms, r.decode_p99_ms);
  }
  return rc;
}

}  // namespace client
}  // namespace attnd
