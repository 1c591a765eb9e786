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
#include "server/config/sparse_config.h"
#include "server/engine/cpu_engine.h"
#include "server/engine/kv_golden_replay_for_testing.h"

namespace attnd {
namespace {

using kv_golden::Errors;
using kv_golden::Golden;
using kv_golden::kTargetMaxAbs;
using kv_golden::kTargetMeanAbs;
using kv_golden::LoadGolden;
using kv_golden::Measure;
using kv_golden::RelativeL2;
using kv_golden::Replay;

// A CpuEngine with two compute threads.
absl::StatusOr<std::unique_ptr<Engine>> MakeCpu(const DcaGeometry& g,
                                                std::shared_ptr<const SparseAttentionConfig> sparse,
                                                const KvLayout& layout) {
  CpuEngineOptions options;
  options.geometry = g;
  options.compute_threads = 2;
  options.sparse = std::move(sparse);
  options.layout = layout;
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(options);
  if (!engine.ok()) return engine.status();
  return std::unique_ptr<Engine>(std::move(*engine));
}

Replay ReplayCase(const Golden& c, DType kv_dtype) {
  return kv_golden::ReplayCase(c, kv_dtype, MakeCpu);
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
