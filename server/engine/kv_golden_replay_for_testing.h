// The golden DCA cases (tests/testdata/dca) replayed through an engine, for the KV accuracy tests
// of both backends (cpu_engine_kv_accuracy_test.cc, cuda_engine_one_byte_kv_test.cc): the case's
// steps as prefill and decode jobs, every output beside the reference's, and the error measures the
// one-byte KV target is stated in (docs/kv_cache.md).
#ifndef ATTND_SERVER_ENGINE_KV_GOLDEN_REPLAY_FOR_TESTING_H_
#define ATTND_SERVER_ENGINE_KV_GOLDEN_REPLAY_FOR_TESTING_H_

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kvcache/kv_layout.h"
#include "nlohmann/json.hpp"
#include "server/config/sparse_config.h"
#include "server/engine/engine.h"
#include "server/engine/engine_jobs_for_testing.h"
#include "tests/testdata/golden_dir.h"

namespace attnd {
namespace kv_golden {

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

inline bool LoadGolden(const std::string& name, Golden* g) {
  const std::string dir = testing::GoldenCaseDir(name);
  std::ifstream json_file(dir + "/case.json");
  if (!json_file) return false;
  g->json = nlohmann::json::parse(json_file, nullptr, /*allow_exceptions=*/false);
  std::stringstream buffer;
  buffer << std::ifstream(dir + "/tensors.bin", std::ios::binary).rdbuf();
  g->blob = buffer.str();
  return !g->json.is_discarded() && !g->blob.empty();
}

inline TensorView View(const std::vector<float>& values, std::vector<int64_t> shape) {
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

// Builds the engine a replay runs on.
using EngineMaker = std::function<absl::StatusOr<std::unique_ptr<Engine>>(
    const DcaGeometry& geometry, std::shared_ptr<const SparseAttentionConfig> sparse,
    const KvLayout& layout)>;

// Runs every step of the case on a fresh engine (`make`) with `kv_dtype` KV. Sequences get
// interleaved pages (sequence s owns ids s, s + n, ...), so pages of different sequences alternate
// in the pool.
inline Replay ReplayCase(const Golden& c, DType kv_dtype, const EngineMaker& make) {
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
  std::shared_ptr<const SparseAttentionConfig> sparse_config;
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
    sparse_config = sparse;
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
  KvLayout layout;
  layout.num_layers = 1;
  layout.num_kv_heads = g.num_kv_heads;
  layout.head_dim = g.head_dim;
  layout.page_size = kPage;
  layout.kv_dtype = kv_dtype;
  layout.num_pages = n * per_seq;
  absl::StatusOr<std::unique_ptr<Engine>> engine = make(g, sparse_config, layout);
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
inline constexpr double kTargetMaxAbs = 4e-2, kTargetMeanAbs = 4e-3;

struct Errors {
  double max_abs = 0, mean_abs = 0;
  size_t over_target = 0;  // outputs off by more than kTargetMaxAbs
  bool finite = true;
};
inline Errors Measure(const std::vector<float>& got, const std::vector<float>& want) {
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

inline double RelativeL2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace kv_golden
}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_KV_GOLDEN_REPLAY_FOR_TESTING_H_
