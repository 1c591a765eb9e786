// What a one-byte KV cache costs in accuracy: the golden DCA cases (tests/testdata/dca: dense
// chunked prefill and batched decode, pre-rotary, vertical-slash sparse) replayed through CpuEngine
// with fp8 E4M3 and with int8 KV against the reference's outputs, beside the same replay with fp32
// and bf16 KV, and the relative L2 of each against the bf16 outputs. The numbers go to the test log
// (docs/kv_cache.md quotes them).
//
// NOTE: the target is max abs <= 4e-2 and mean abs <= 4e-3 per case. int8 (7 bits of magnitude
// under a per-row scale) meets it on the dense cases and is held to it there; on sparse_vs it
// meets the mean but not the max (0.34, in 591 of 567,296 outputs): the vertical-slash pattern is
// estimated from the rounded keys, so a few query rows select a different key set, a discrete
// change no precision bar covers (fp8 shows the same, worse). There int8 is held to its measured
// max with a margin and to the target's mean. E4M3 misses both (max
// 0.09-0.42, mean ~4.0-4.7e-3): its kernels are exact against a reference that quantises the same
// way (cpu_engine_test, kernels/dca_cpu_test), so this is the format, whose 3 mantissa bits round
// each cached element by up to 1/16 of itself (~3.6% RMS), K and V about equally. fp8 is therefore
// held to the envelope measured for each case (a regression bar that a wrong scale or a
// requantised token would break) and the target is printed beside it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kvcache/kv_layout.h"
#include "nlohmann/json.hpp"
#include "server/config/sparse_config.h"
#include "server/engine/cpu_engine.h"
#include "server/engine/engine_jobs_for_testing.h"
#include "tests/testdata/golden_dir.h"

namespace attnd {
namespace {

struct Golden {
  nlohmann::json json;
  std::string blob;

  // A tensor of the case as fp32 values (its bf16 or f32 bytes converted exactly).
  std::vector<float> Get(const std::string& name) const {
    const nlohmann::json& e = json.at("tensors").at(name);
    const DType dt = e.at("dtype") == "bf16" ? DType::kBf16 : DType::kFp32;
    std::vector<float> v(e.at("nbytes").get<size_t>() / ElementSize(dt));
    ConvertToFloat(blob.data() + e.at("offset").get<size_t>(), dt, v.size(), v.data());
    return v;
  }
};

bool LoadGolden(const std::string& name, Golden* g) {
  const std::string dir = testing::GoldenCaseDir(name);
  std::ifstream json_file(dir + "/case.json");
  if (!json_file) return false;
  g->json = nlohmann::json::parse(json_file, nullptr, /*allow_exceptions=*/false);
  std::stringstream buffer;
  buffer << std::ifstream(dir + "/tensors.bin", std::ios::binary).rdbuf();
  g->blob = buffer.str();
  return !g->json.is_discarded() && !g->blob.empty();
}

TensorView View(const std::vector<float>& values, std::vector<int64_t> shape) {
  TensorView v;
  v.dtype = DType::kFp32;
  v.data = values.data();
  v.shape = std::move(shape);
  return v;
}

// Every output of one replay, in step order, and the reference's.
struct Replay {
  std::vector<float> got, want;
};

// Runs every step of the case on a fresh CpuEngine with `kv_dtype` KV. Sequences get interleaved
// pages (sequence s owns ids s, s + n, ...), so pages of different sequences alternate in the pool.
Replay ReplayCase(const Golden& c, DType kv_dtype) {
  const nlohmann::json& j = c.json;
  const nlohmann::json& dca = j.at("dual_chunk_attention_config");
  DcaGeometry g;
  g.num_q_heads = j.at("num_q_heads");
  g.num_kv_heads = j.at("num_kv_heads");
  g.head_dim = j.at("head_dim");
  g.softmax_scale = j.at("softmax_scale").get<float>();
  g.chunk_size = dca.at("chunk_size");
  g.chunk_len = g.chunk_size - dca.at("local_size").get<int64_t>();
  g.original_max_position_embeddings = dca.at("original_max_position_embeddings");
  const bool pre_rotary = j.value("q_layout", "") == "pre_rotary";
  if (pre_rotary) {
    g.rope_theta = j.at("rope_theta");
    g.rotary_dim = j.at("rotary_dim");
  }
  CpuEngineOptions options;
  options.geometry = g;
  options.compute_threads = 2;
  if (dca.contains("sparse_attention_config")) {
    auto sparse = std::make_shared<SparseAttentionConfig>();
    absl::StatusOr<std::vector<VsBudget>> budgets =
        ParseSparsePattern(dca.at("sparse_attention_config").dump(), "case.json", 1, g.num_q_heads);
    EXPECT_TRUE(budgets.ok()) << budgets.status();
    if (!budgets.ok()) return {};
    sparse->num_layers = 1;
    sparse->num_q_heads = g.num_q_heads;
    sparse->budgets = *budgets;
    sparse->enabled = dca.value("sparse_attention_enabled", true);
    sparse->threshold = dca.at("sparse_attention_threshold");
    sparse->last_q = dca.at("sparse_attention_last_q");
    options.sparse = sparse;
  }
  // Pages: every sequence's final length, rounded up, times the number of sequences.
  constexpr int32_t kPage = 16;
  std::vector<int64_t> final_len;
  for (const nlohmann::json& step : j.at("steps")) {
    if (step.at("op") == "prefill") {
      const size_t s = step.at("seq");
      final_len.resize(std::max(final_len.size(), s + 1), 0);
      final_len[s] = std::max<int64_t>(
          final_len[s], step.at("start").get<int64_t>() + step.at("tokens").get<int64_t>());
    } else {
      const std::vector<size_t> seqs = step.at("seqs");
      const std::vector<int64_t> lens = step.at("lens_after");
      for (size_t i = 0; i < seqs.size(); ++i) final_len[seqs[i]] = lens[i];
    }
  }
  const int64_t n = static_cast<int64_t>(final_len.size());
  const int64_t per_seq =
      (*std::max_element(final_len.begin(), final_len.end()) + kPage - 1) / kPage;
  std::vector<std::vector<int32_t>> pages(n);
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t p = 0; p < per_seq; ++p) pages[s].push_back(static_cast<int32_t>(s + p * n));
  }
  options.layout.num_layers = 1;
  options.layout.num_kv_heads = g.num_kv_heads;
  options.layout.head_dim = g.head_dim;
  options.layout.page_size = kPage;
  options.layout.kv_dtype = kv_dtype;
  options.layout.num_pages = n * per_seq;
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};

  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  Replay r;
  for (const nlohmann::json& step : j.at("steps")) {
    const std::vector<float> q = c.Get(step.at("q")), k = c.Get(step.at("k")),
                             v = c.Get(step.at("v")), want = c.Get(step.at("out"));
    std::vector<float> out(want.size(), std::nanf(""));
    if (step.at("op") == "prefill") {
      const int64_t t = step.at("tokens");
      const size_t s = step.at("seq");
      PrefillJob job = EngineJobsForTesting::Prefill();
      job.page_table = pages[s].data();
      job.num_pages = per_seq;
      job.start = step.at("start");
      job.num_tokens = t;
      job.prompt_len = step.at("prompt_len");
      job.q_layout = pre_rotary ? QLayout::kPreRotary : QLayout::kVariants;
      job.q = pre_rotary ? View(q, {t, hq, d}) : View(q, {t, kNumQueryVariants, hq, d});
      job.k = View(k, {t, hkv, d});
      job.v = View(v, {t, hkv, d});
      job.out = out.data();
      const absl::Status status = (*engine)->Prefill(job);
      EXPECT_TRUE(status.ok()) << status;
    } else {
      const std::vector<size_t> seqs = step.at("seqs");
      const std::vector<int64_t> lens = step.at("lens_after");
      const int64_t b = static_cast<int64_t>(seqs.size());
      const int64_t q_row = (pre_rotary ? 1 : kNumQueryVariants) * hq * d;
      DecodeJob job = EngineJobsForTesting::Decode();
      for (int64_t i = 0; i < b; ++i) {
        DecodeJob::Entry e;
        e.page_table = pages[seqs[i]].data();
        e.num_pages = per_seq;
        e.length = lens[i];
        TensorView qv;
        qv.data = q.data() + i * q_row;
        qv.shape = pre_rotary ? std::vector<int64_t>{hq, d}
                              : std::vector<int64_t>{kNumQueryVariants, hq, d};
        e.q = qv;
        e.k = View(k, {hkv, d});
        e.k.data = k.data() + i * hkv * d;
        e.v = View(v, {hkv, d});
        e.v.data = v.data() + i * hkv * d;
        e.out = out.data() + i * hq * d;
        e.q_layout = pre_rotary ? QLayout::kPreRotary : QLayout::kVariants;
        job.entries.push_back(e);
      }
      const absl::StatusOr<DecodeStats> stats = (*engine)->Decode(job);
      EXPECT_TRUE(stats.ok()) << stats.status();
    }
    r.got.insert(r.got.end(), out.begin(), out.end());
    r.want.insert(r.want.end(), want.begin(), want.end());
  }
  return r;
}

// The accuracy target for a one-byte KV cache (docs/kv_cache.md).
constexpr double kTargetMaxAbs = 4e-2, kTargetMeanAbs = 4e-3;

struct Errors {
  double max_abs = 0, mean_abs = 0;
  size_t over_target = 0;  // outputs off by more than kTargetMaxAbs
  bool finite = true;
};
Errors Measure(const std::vector<float>& got, const std::vector<float>& want) {
  Errors e;
  double sum = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) e.finite = false;
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    e.max_abs = std::max(e.max_abs, err);
    if (err > kTargetMaxAbs) ++e.over_target;
    sum += err;
  }
  e.mean_abs = got.empty() ? 0 : sum / got.size();
  return e;
}

double RelativeL2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

struct Case {
  const char* name;
  double fp8_max_abs;  // fp8's envelope: measured on the dev machine, plus about 30%
  double fp8_mean_abs;
  double int8_max_abs = kTargetMaxAbs;  // the target, or (sparse_vs) the measured max + ~30%
  double int8_mean_abs = kTargetMeanAbs;
};

class KvAccuracyGoldenTest : public ::testing::TestWithParam<Case> {};

TEST_P(KvAccuracyGoldenTest, Int8MeetsItsBarsAndFp8StaysInsideItsEnvelope) {
  const Case& want = GetParam();
  Golden c;
  ASSERT_TRUE(LoadGolden(want.name, &c))
      << "no golden case " << want.name << " (//tests/testdata:dca in the test's data)";
  const Replay fp32 = ReplayCase(c, DType::kFp32), bf16 = ReplayCase(c, DType::kBf16),
               fp8 = ReplayCase(c, DType::kFp8E4m3), int8 = ReplayCase(c, DType::kInt8);
  for (const Replay* r : {&fp32, &fp8, &int8}) {
    ASSERT_FALSE(r->got.empty());
    ASSERT_EQ(r->got.size(), r->want.size());
    ASSERT_EQ(r->got.size(), bf16.got.size());
  }
  const Errors e32 = Measure(fp32.got, fp32.want), e16 = Measure(bf16.got, bf16.want),
               e8 = Measure(fp8.got, fp8.want), ei8 = Measure(int8.got, int8.want);
  const double l2_fp8 = RelativeL2(fp8.got, bf16.got), l2_int8 = RelativeL2(int8.got, bf16.got);
  auto meets = [](const Errors& e) {
    return e.max_abs <= kTargetMaxAbs && e.mean_abs <= kTargetMeanAbs;
  };
  std::printf(
      "golden %-18s %7zu outputs | fp32 KV max %.3g mean %.3g | bf16 KV max %.3g mean %.3g | "
      "fp8 KV max %.3g mean %.3g (%zu over %.0e), rel L2 vs bf16 %.3g, target %s | int8 KV max "
      "%.3g mean %.3g (%zu over %.0e), rel L2 vs bf16 %.3g, target %s | target (%.0e, %.0e)\n",
      want.name, fp8.got.size(), e32.max_abs, e32.mean_abs, e16.max_abs, e16.mean_abs, e8.max_abs,
      e8.mean_abs, e8.over_target, kTargetMaxAbs, l2_fp8, meets(e8) ? "met" : "MISSED", ei8.max_abs,
      ei8.mean_abs, ei8.over_target, kTargetMaxAbs, l2_int8, meets(ei8) ? "met" : "MISSED",
      kTargetMaxAbs, kTargetMeanAbs);
  RecordProperty("fp8_max_abs", absl::StrCat(e8.max_abs));
  RecordProperty("fp8_mean_abs", absl::StrCat(e8.mean_abs));
  RecordProperty("fp8_vs_bf16_rel_l2", absl::StrCat(l2_fp8));
  RecordProperty("int8_max_abs", absl::StrCat(ei8.max_abs));
  RecordProperty("int8_mean_abs", absl::StrCat(ei8.mean_abs));
  RecordProperty("int8_vs_bf16_rel_l2", absl::StrCat(l2_int8));
  EXPECT_LE(e32.max_abs, 1e-4);  // the golden files' own bar: the replay itself is right

  EXPECT_TRUE(ei8.finite);
  EXPECT_LE(ei8.max_abs, want.int8_max_abs);
  EXPECT_LE(ei8.mean_abs, want.int8_mean_abs);

  EXPECT_TRUE(e8.finite);
  EXPECT_LE(e8.max_abs, want.fp8_max_abs);
  EXPECT_LE(e8.mean_abs, want.fp8_mean_abs);
  EXPECT_LE(l2_fp8, 0.08);

  // Both caches really are one byte an element (not silently kept in a wider type): lossier than
  // bf16, and int8's 7 bits of magnitude are finer than E4M3's 3 of mantissa.
  EXPECT_GT(e8.mean_abs, 4 * e16.mean_abs);
  EXPECT_GT(ei8.mean_abs, 2 * e16.mean_abs);
  EXPECT_LT(ei8.mean_abs, e8.mean_abs);
}

// Measured (dev machine, 2 threads), max / mean abs: dense_gqa_chunked fp8 0.0918 / 0.00428, int8
// 0.0161 / 0.00101; dense_pre_rotary fp8 0.115 / 0.00471, int8 0.0199 / 0.00113; sparse_vs fp8
// 0.424 / 0.00402, int8 0.34 / 0.00141 (there the sparse pattern is also estimated from the rounded
// keys, so a row may attend a different key set).
INSTANTIATE_TEST_SUITE_P(Cases, KvAccuracyGoldenTest,
                         ::testing::Values(Case{"dense_gqa_chunked", 0.12, 5.5e-3},
                                           Case{"dense_pre_rotary", 0.15, 6e-3},
                                           Case{"sparse_vs", 0.55, 5.5e-3, 0.45}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace attnd
