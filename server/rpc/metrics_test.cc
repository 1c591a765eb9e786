#include "server/rpc/metrics.h"

#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

using ::testing::HasSubstr;

// A strict parser for the subset of text format 0.0.4 we emit. Every sample must follow a
// "# TYPE" line of its family; label values are unescaped.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value;
};

struct Exposition {
  std::map<std::string, std::string> types;  // family -> counter|gauge|histogram
  std::map<std::string, std::string> helps;
  std::vector<Sample> samples;

  // The value of the one sample with this name and exactly these labels; fails the test otherwise.
  double Get(const std::string& name, const std::map<std::string, std::string>& labels = {}) const {
    const Sample* found = nullptr;
    for (const Sample& s : samples) {
      if (s.name == name && s.labels == labels) {
        EXPECT_EQ(found, nullptr) << "duplicate sample " << name;
        found = &s;
      }
    }
    EXPECT_NE(found, nullptr) << "no sample " << name;
    return found ? found->value : std::nan("");
  }
  bool Has(const std::string& name, const std::map<std::string, std::string>& labels) const {
    for (const Sample& s : samples) {
      if (s.name == name && s.labels == labels) return true;
    }
    return false;
  }
};

double ParseValue(const std::string& text) {
  if (text == "+Inf") return INFINITY;
  if (text == "-Inf") return -INFINITY;
  if (text == "NaN") return NAN;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  EXPECT_EQ(*end, '\0') << "bad value '" << text << "'";
  return v;
}

Exposition Parse(const std::string& text) {
  Exposition e;
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "exposition must end with a line feed";
  std::string current_family;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# HELP ")) {
      std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(' ', 1));
      EXPECT_EQ(parts.size(), 2u);
      e.helps[parts[0]] = parts.size() == 2 ? parts[1] : "";
      continue;
    }
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      EXPECT_EQ(parts.size(), 2u) << line;
      EXPECT_EQ(e.types.count(parts[0]), 0u) << "TYPE twice for " << parts[0];
      EXPECT_EQ(e.helps.count(parts[0]), 1u) << "HELP must precede TYPE for " << parts[0];
      e.types[parts[0]] = parts[1];
      current_family = parts[0];
      continue;
    }
    EXPECT_NE(line[0], '#') << "unexpected comment " << line;
    Sample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = std::string(line.substr(0, i));
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (line[i] != '}') {
        size_t eq = line.find('=', i);
        std::string label(line.substr(i, eq - i));
        EXPECT_EQ(line[eq + 1], '"');
        std::string value;
        size_t j = eq + 2;
        for (; line[j] != '"'; ++j) {
          if (line[j] == '\\') {
            ++j;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        EXPECT_EQ(s.labels.count(label), 0u) << "label twice: " << label;
        s.labels[label] = value;
        i = j + 1;
        if (line[i] == ',') ++i;
      }
      ++i;
    }
    EXPECT_EQ(line[i], ' ') << line;
    s.value = ParseValue(std::string(line.substr(i + 1)));
    // The sample belongs to the family whose TYPE came last.
    const std::string& type = e.types[current_family];
    if (type == "histogram") {
      EXPECT_TRUE(s.name == current_family + "_bucket" || s.name == current_family + "_sum" ||
                  s.name == current_family + "_count")
          << s.name << " under histogram " << current_family;
    } else {
      EXPECT_EQ(s.name, current_family);
    }
    e.samples.push_back(std::move(s));
  }
  return e;
}

TEST(MetricsRegistryTest, CountersWithLabelsRenderAndEscape) {
  MetricsRegistry registry;
  auto requests =
      registry.AddCounter("test_requests_total", "Requests.\nSecond \\ line.", {"rpc", "code"});
  ASSERT_TRUE(requests.ok()) << requests.status();
  (*requests)->Increment({"Prefill", "OK"});
  (*requests)->Increment({"Prefill", "OK"}, 2);
  (*requests)->Increment({"Decode", "NOT_FOUND"});
  (*requests)->Increment({"we\"ird\\", "a\nb"}, 0.5);
  (*requests)->Increment({"Prefill", "OK"}, -5);  // ignored: counters never go down

  EXPECT_EQ((*requests)->Value({"Prefill", "OK"}), 3);
  EXPECT_EQ((*requests)->Value({"Decode", "OK"}), 0);

  const std::string text = registry.RenderPrometheusText();
  EXPECT_THAT(text, HasSubstr("# HELP test_requests_total Requests.\\nSecond \\\\ line.\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE test_requests_total counter\n"));
  EXPECT_THAT(text, HasSubstr("test_requests_total{rpc=\"we\\\"ird\\\\\",code=\"a\\nb\"} 0.5\n"));
  Exposition e = Parse(text);
  EXPECT_EQ(e.types["test_requests_total"], "counter");
  EXPECT_EQ(e.Get("test_requests_total", {{"rpc", "Prefill"}, {"code", "OK"}}), 3);
  EXPECT_EQ(e.Get("test_requests_total", {{"rpc", "Decode"}, {"code", "NOT_FOUND"}}), 1);
  EXPECT_EQ(e.Get("test_requests_total", {{"rpc", "we\"ird\\"}, {"code", "a\nb"}}), 0.5);
  EXPECT_EQ(e.samples.size(), 3u);
}

TEST(MetricsRegistryTest, UnlabeledFamiliesStartAtZeroAndGaugesMove) {
  MetricsRegistry registry;
  auto counter = registry.AddCounter("test_events_total", "Events.");
  auto gauge = registry.AddGauge("test_level", "Level.");
  auto labeled = registry.AddGauge("test_labeled", "Labeled.", {"kind"});
  ASSERT_TRUE(counter.ok() && gauge.ok() && labeled.ok());
  Exposition before = Parse(registry.RenderPrometheusText());
  EXPECT_EQ(before.Get("test_events_total"), 0);
  EXPECT_EQ(before.Get("test_level"), 0);
  EXPECT_EQ(before.types["test_labeled"], "gauge");
  EXPECT_FALSE(before.Has("test_labeled", {}));  // labeled families show no series until set

  (*gauge)->Set({}, 10);
  (*gauge)->Add({}, -2.5);
  (*labeled)->Set({"a"}, -1);
  (*counter)->Increment({}, 1234567891);  // large counts must not lose digits
  Exposition after = Parse(registry.RenderPrometheusText());
  EXPECT_EQ(after.Get("test_level"), 7.5);
  EXPECT_EQ(after.Get("test_labeled", {{"kind", "a"}}), -1);
  EXPECT_EQ(after.Get("test_events_total"), 1234567891);
  EXPECT_THAT(registry.RenderPrometheusText(), HasSubstr("test_events_total 1234567891\n"));
}

TEST(MetricsRegistryTest, HistogramBucketsAreCumulative) {
  MetricsRegistry registry;
  auto hist = registry.AddHistogram("test_latency_seconds", "Latency.", {"rpc"}, {0.1, 0.5, 1});
  ASSERT_TRUE(hist.ok()) << hist.status();
  for (double v : {0.05, 0.1, 0.3, 0.7, 2.0, 3.0}) (*hist)->Observe({"Decode"}, v);
  (*hist)->Observe({"Decode"}, std::nan(""));  // ignored

  HistogramFamily::Snapshot snap = (*hist)->Get({"Decode"});
  EXPECT_EQ(snap.bucket_counts, (std::vector<uint64_t>{2, 1, 1, 2}));  // 0.1 is in le="0.1"
  EXPECT_EQ(snap.count, 6u);
  EXPECT_DOUBLE_EQ(snap.sum, 6.15);

  const std::string text = registry.RenderPrometheusText();
  Exposition e = Parse(text);
  EXPECT_EQ(e.types["test_latency_seconds"], "histogram");
  EXPECT_EQ(e.Get("test_latency_seconds_bucket", {{"rpc", "Decode"}, {"le", "0.1"}}), 2);
  EXPECT_EQ(e.Get("test_latency_seconds_bucket", {{"rpc", "Decode"}, {"le", "0.5"}}), 3);
  EXPECT_EQ(e.Get("test_latency_seconds_bucket", {{"rpc", "Decode"}, {"le", "1"}}), 4);
  EXPECT_EQ(e.Get("test_latency_seconds_bucket", {{"rpc", "Decode"}, {"le", "+Inf"}}), 6);
  EXPECT_EQ(e.Get("test_latency_seconds_count", {{"rpc", "Decode"}}), 6);
  EXPECT_DOUBLE_EQ(e.Get("test_latency_seconds_sum", {{"rpc", "Decode"}}), 6.15);
  // le comes last and buckets appear in increasing order.
  EXPECT_LT(text.find("le=\"0.1\""), text.find("le=\"0.5\""));
  EXPECT_LT(text.find("le=\"1\""), text.find("le=\"+Inf\""));
}

TEST(MetricsRegistryTest, RejectsInvalidRegistrations) {
  MetricsRegistry registry;
  ASSERT_TRUE(registry.AddCounter("ok_total", "x").ok());
  auto dup = registry.AddGauge("ok_total", "x");
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dup.status().message(), "metric 'ok_total' registered twice");
  auto bad_name = registry.AddCounter("9lives", "x");
  EXPECT_EQ(bad_name.status().message(), "invalid metric name '9lives'");
  auto bad_label = registry.AddCounter("a_total", "x", {"__reserved"});
  EXPECT_EQ(bad_label.status().message(), "metric 'a_total': invalid label name '__reserved'");
  auto repeated = registry.AddCounter("b_total", "x", {"rpc", "rpc"});
  EXPECT_EQ(repeated.status().message(), "metric 'b_total': label 'rpc' repeated");
  auto le = registry.AddHistogram("h", "x", {"le"}, {1});
  EXPECT_EQ(le.status().message(), "histogram 'h': 'le' is reserved for buckets");
  auto unsorted = registry.AddHistogram("h", "x", {}, {1, 1});
  EXPECT_EQ(unsorted.status().message(),
            "histogram 'h': bucket bounds must be finite and strictly increasing");
  auto empty = registry.AddHistogram("h", "x", {}, {});
  EXPECT_EQ(empty.status().message(), "histogram 'h': no buckets");
}

TEST(MetricsRegistryTest, CollectHooksRunBeforeRender) {
  MetricsRegistry registry;
  auto gauge = registry.AddGauge("test_sampled", "Sampled at scrape.");
  ASSERT_TRUE(gauge.ok());
  int calls = 0;
  registry.AddCollectHook([&] { (*gauge)->Set({}, ++calls * 10); });
  EXPECT_EQ(Parse(registry.RenderPrometheusText()).Get("test_sampled"), 10);
  EXPECT_EQ(Parse(registry.RenderPrometheusText()).Get("test_sampled"), 20);
}

TEST(MetricsRegistryTest, ConcurrentRecordingLosesNothing) {
  MetricsRegistry registry;
  auto counter = registry.AddCounter("test_concurrent_total", "x", {"rpc"});
  auto hist = registry.AddHistogram("test_concurrent_seconds", "x", {}, {1});
  ASSERT_TRUE(counter.ok() && hist.ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5000; ++i) {
        (*counter)->Increment({t % 2 ? "Decode" : "Prefill"});
        (*hist)->Observe({}, 0.5);
        if (i % 1000 == 0) registry.RenderPrometheusText();
      }
    });
  }
  for (auto& th : threads) th.join();
  Exposition e = Parse(registry.RenderPrometheusText());
  EXPECT_EQ(e.Get("test_concurrent_total", {{"rpc", "Decode"}}), 10000);
  EXPECT_EQ(e.Get("test_concurrent_total", {{"rpc", "Prefill"}}), 10000);
  EXPECT_EQ(e.Get("test_concurrent_seconds_count"), 20000);
  EXPECT_EQ(e.Get("test_concurrent_seconds_bucket", {{"le", "1"}}), 20000);
}

TEST(AttndMetricsTest, ExportsTheIssueFamilies) {
  auto metrics = AttndMetrics::Create({"0.1.0", "abc123", "cpu", "tiny"});
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  AttndMetrics& m = **metrics;
  m.RecordRequest("Prefill", "OK", 0.001, 0.02, 0.025, 4096, 1024);
  m.RecordRequest("Prefill", "RESOURCE_EXHAUSTED", 0.002, 0.0005, 0.003, 4096, 0);
  m.RecordRequest("Decode", StatusCodeName(5), -1, -1, 0.0002, 100, 0);
  m.decode_batch_size->Observe({}, 3);
  m.decode_batch_size->Observe({}, 64);
  m.graph_replays_total->Increment({});
  m.idle_reclaimed_total->Increment({}, 2);
  m.auth_failures_total->Increment({"invalid"});
  m.registry().AddCollectHook([&m] {
    m.kv_pages_used->Set({}, 30);
    m.kv_pages_free->Set({}, 70);
    m.live_sequences->Set({}, 4);
  });

  Exposition e = Parse(m.registry().RenderPrometheusText());
  EXPECT_EQ(e.Get("attnd_requests_total", {{"rpc", "Prefill"}, {"code", "OK"}}), 1);
  EXPECT_EQ(e.Get("attnd_requests_total", {{"rpc", "Prefill"}, {"code", "RESOURCE_EXHAUSTED"}}), 1);
  EXPECT_EQ(e.Get("attnd_requests_total", {{"rpc", "Decode"}, {"code", "NOT_FOUND"}}), 1);
  EXPECT_FALSE(e.Has("attnd_request_failures_total", {{"rpc", "Prefill"}, {"code", "OK"}}));
  EXPECT_EQ(
      e.Get("attnd_request_failures_total", {{"rpc", "Prefill"}, {"code", "RESOURCE_EXHAUSTED"}}),
      1);
  EXPECT_EQ(e.Get("attnd_request_queue_seconds_count", {{"rpc", "Prefill"}}), 2);
  EXPECT_FALSE(e.Has("attnd_request_queue_seconds_count", {{"rpc", "Decode"}}));  // skipped (<0)
  EXPECT_DOUBLE_EQ(e.Get("attnd_request_compute_seconds_sum", {{"rpc", "Prefill"}}), 0.0205);
  EXPECT_EQ(e.Get("attnd_request_duration_seconds_count", {{"rpc", "Decode"}}), 1);
  EXPECT_EQ(e.Get("attnd_request_duration_seconds_bucket", {{"rpc", "Decode"}, {"le", "0.0002"}}),
            1);
  EXPECT_EQ(e.Get("attnd_request_duration_seconds_bucket", {{"rpc", "Decode"}, {"le", "0.0001"}}),
            0);
  EXPECT_EQ(e.Get("attnd_decode_batch_size_bucket", {{"le", "4"}}), 1);
  EXPECT_EQ(e.Get("attnd_decode_batch_size_bucket", {{"le", "64"}}), 2);
  EXPECT_EQ(e.Get("attnd_decode_batch_size_count"), 2);
  EXPECT_EQ(e.Get("attnd_cuda_graph_replays_total"), 1);
  EXPECT_EQ(e.Get("attnd_kv_pages_used"), 30);
  EXPECT_EQ(e.Get("attnd_kv_pages_free"), 70);
  EXPECT_EQ(e.Get("attnd_live_sequences"), 4);
  EXPECT_EQ(e.Get("attnd_received_bytes_total", {{"rpc", "Prefill"}}), 8192);
  EXPECT_EQ(e.Get("attnd_sent_bytes_total", {{"rpc", "Prefill"}}), 1024);
  EXPECT_EQ(
      e.Get("attnd_build_info",
            {{"version", "0.1.0"}, {"revision", "abc123"}, {"backend", "cpu"}, {"model", "tiny"}}),
      1);
  EXPECT_EQ(e.Get("attnd_sequences_idle_reclaimed_total"), 2);
  EXPECT_EQ(e.Get("attnd_auth_failures_total", {{"reason", "invalid"}}), 1);
  EXPECT_EQ(e.types["attnd_request_duration_seconds"], "histogram");
  EXPECT_EQ(e.types["attnd_kv_pages_free"], "gauge");
  EXPECT_EQ(e.types["attnd_requests_total"], "counter");
}

TEST(AttndMetricsTest, StatusCodeNames) {
  EXPECT_EQ(StatusCodeName(0), "OK");
  EXPECT_EQ(StatusCodeName(8), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(14), "UNAVAILABLE");
  EXPECT_EQ(StatusCodeName(16), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeName(17), "UNKNOWN");
  EXPECT_EQ(StatusCodeName(-1), "UNKNOWN");
}

}  // namespace
}  // namespace attnd
