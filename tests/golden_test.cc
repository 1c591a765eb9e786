// Replays the golden DCA cases dense_gqa_chunked and dense_pre_rotary (tests/testdata/dca;
// pre-rotary q and k: the server applies the dual-chunk rotary) through a daemon over loopback gRPC: chunked prefill with the case's prompt_len, then
// batched decode of two sequences across a chunk boundary. fp32 requests must match the golden
// outputs within 1e-4; bf16 requests within DCA.md's bf16 bars.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "nlohmann/json.hpp"
#include "server/cuda_engine.h"
#include "tests/test_util.h"
#include "tests/testdata/golden_dir.h"

// golden_cuda_test builds this file with ATTND_GOLDEN_ON_CUDA: the same replay against the CUDA
// backend (bf16 K/V on the device, so every request dtype is held to DCA.md's bf16 bars).
#ifdef ATTND_GOLDEN_ON_CUDA
constexpr bool kOnCuda = true;
#else
constexpr bool kOnCuda = false;
#endif

namespace attnd {
namespace {

using client::DecodeInput;
using client::HostTensor;

struct Tensor {
  std::string dtype;  // "bf16" | "f32"
  std::vector<int64_t> shape;
  std::vector<float> values;
};

class GoldenCase {
 public:
  bool Load(const std::string& dir) {
    std::ifstream json_file(dir + "/case.json");
    if (!json_file) return false;
    json_file >> json_;
    std::ifstream bin(dir + "/tensors.bin", std::ios::binary);
    std::stringstream buffer;
    buffer << bin.rdbuf();
    blob_ = buffer.str();
    return !blob_.empty();
  }
  const nlohmann::json& json() const { return json_; }

  Tensor Get(const std::string& name) const {
    const nlohmann::json& entry = json_.at("tensors").at(name);
    Tensor t;
    t.dtype = entry.at("dtype").get<std::string>();
    t.shape = entry.at("shape").get<std::vector<int64_t>>();
    const int64_t offset = entry.at("offset").get<int64_t>();
    const int64_t nbytes = entry.at("nbytes").get<int64_t>();
    const DType dtype = t.dtype == "bf16" ? DType::kBf16 : DType::kFp32;
    const size_t n = nbytes / ElementSize(dtype);
    t.values.resize(n);
    ConvertToFloat(blob_.data() + offset, dtype, n, t.values.data());
    return t;
  }

 private:
  nlohmann::json json_;
  std::string blob_;
};

// (request dtype, over a Session stream instead of unary calls)
class GoldenTest : public ::testing::TestWithParam<std::tuple<DType, bool>> {
 protected:
  // The case's steps as requests (pre_rotary: q [T, Hq, D] / [Hq, D], Q_LAYOUT_PRE_ROTARY).
  void Replay(const GoldenCase& golden, const std::string& name, bool pre_rotary);
};

TEST_P(GoldenTest, DenseGqaChunked) {
  const std::string dir = testing::GoldenCaseDir("dense_gqa_chunked");
  GoldenCase golden;
  ASSERT_TRUE(golden.Load(dir)) << "cannot read the golden case in " << dir
                                << " (//tests/testdata:dca in the test's data)";
  Replay(golden, "golden-dense-gqa-chunked", /*pre_rotary=*/false);
}

TEST_P(GoldenTest, DensePreRotary) {
  const std::string dir = testing::GoldenCaseDir("dense_pre_rotary");
  GoldenCase golden;
  ASSERT_TRUE(golden.Load(dir)) << "cannot read the golden case in " << dir
                                << " (//tests/testdata:dca in the test's data)";
  const nlohmann::json& c = golden.json();
  ASSERT_EQ(c.at("q_layout"), "pre_rotary");
  ASSERT_EQ(c.at("rope_style"), "neox");
  ASSERT_EQ(c.at("rotary_dim"), c.at("head_dim")) << "the config below has no partial rotary";
  Replay(golden, "golden-dense-pre-rotary", /*pre_rotary=*/true);
}

void GoldenTest::Replay(const GoldenCase& golden, const std::string& name, bool pre_rotary) {
  const DType dtype = std::get<0>(GetParam());
  const bool use_session = std::get<1>(GetParam());
  const nlohmann::json& c = golden.json();
  testing::ModelGeometry geometry;
  geometry.name = name;
  if (pre_rotary) geometry.rope_theta = c.at("rope_theta").get<double>();
  geometry.num_layers = 1;
  geometry.num_q_heads = c.at("num_q_heads");
  geometry.num_kv_heads = c.at("num_kv_heads");
  geometry.head_dim = c.at("head_dim");
  const nlohmann::json& dca = c.at("dual_chunk_attention_config");
  geometry.chunk_size = dca.at("chunk_size");
  geometry.local_size = dca.at("local_size");
  geometry.original_max_position_embeddings = dca.at("original_max_position_embeddings");
  geometry.max_position_embeddings = 8192;
  ASSERT_FLOAT_EQ(c.at("softmax_scale").get<float>(), geometry.dca().softmax_scale)
      << "the case's softmax scale is not 1/sqrt(head_dim); the config cannot express it";

  if (kOnCuda && attnd::CudaDeviceCount() == 0) {
    std::fprintf(stderr, "*** SKIPPING GPU TEST: golden_cuda_test: no CUDA device ***\n");
    GTEST_SKIP() << "no CUDA device: golden_cuda_test runs on a GPU machine (docs/BENCHMARKS.md)";
  }
  ServerOptions options;
  options.page_size = 16;
  ASSERT_EQ(geometry.chunk_len() % options.page_size, 0);
  options.device = kOnCuda ? "cuda" : "cpu";
  options.kv_dtype = kOnCuda ? "bf16" : "fp32";
  options.kv_cache_bytes = 32ll << 20;
  options.compute_threads = 2;
  absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
      testing::TestDaemon::Start(geometry, options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::AttndClient& client = (*daemon)->client();
  std::unique_ptr<client::Session> session;
  if (use_session) {
    absl::StatusOr<std::unique_ptr<client::Session>> opened = client.OpenSession();
    ASSERT_TRUE(opened.ok()) << opened.status();
    session = std::move(*opened);
  }

  // The case's sequence numbers -> server ids, created on first use.
  std::vector<std::string> ids;
  auto id_of = [&](int seq) -> std::string {
    while (static_cast<int>(ids.size()) <= seq) {
      absl::StatusOr<std::string> id = client.CreateSequence();
      EXPECT_TRUE(id.ok()) << id.status();
      ids.push_back(id.ok() ? *id : "");
    }
    return ids[seq];
  };

  // fp32 is the golden path (1e-4); bf16 has DCA.md's bars against the fp32 reference.
  const bool exact = dtype == DType::kFp32 && !kOnCuda;
  const double max_bar = exact ? 1e-4 : 2e-2;
  const double mean_bar = exact ? 1e-4 : 2e-3;
  const v1::QLayout layout = pre_rotary ? v1::Q_LAYOUT_PRE_ROTARY : v1::Q_LAYOUT_VARIANTS;
  const int64_t q_variants = pre_rotary ? 1 : 5;  // q rows per token as sent
  const int64_t q_row = q_variants * geometry.num_q_heads * geometry.head_dim;
  const int64_t kv_row = geometry.kv_elems_per_token();
  const int64_t o_row = geometry.o_elems_per_token();
  int steps = 0;
  double worst = 0;
  for (const nlohmann::json& step : c.at("steps")) {
    const std::string op = step.at("op");
    const Tensor q = golden.Get(step.at("q"));
    const Tensor k = golden.Get(step.at("k"));
    const Tensor v = golden.Get(step.at("v"));
    const Tensor out = golden.Get(step.at("out"));
    SCOPED_TRACE(absl::StrCat("step ", steps, " (", op, ")"));
    if (op == "prefill") {
      const int64_t tokens = step.at("tokens");
      const int64_t start = step.at("start");
      const std::string id = id_of(step.at("seq"));
      // AttndClient and Session have the same Prefill signature.
      auto prefill = [&](auto& target) {
        const int64_t hq = geometry.num_q_heads, hkv = geometry.num_kv_heads;
        const int64_t d = geometry.head_dim;
        const std::vector<int64_t> q_shape =
            pre_rotary ? std::vector<int64_t>{tokens, hq, d}
                       : std::vector<int64_t>{tokens, 5, hq, d};
        return target.Prefill(id, 0, HostTensor::FromFloats(dtype, q_shape, q.values),
                              HostTensor::FromFloats(dtype, {tokens, hkv, d}, k.values),
                              HostTensor::FromFloats(dtype, {tokens, hkv, d}, v.values),
                              step.at("prompt_len").get<int64_t>(), layout);
      };
      absl::StatusOr<client::PrefillResult> r = use_session ? prefill(*session) : prefill(client);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->length, start + tokens);
      EXPECT_EQ(r->o.dtype, dtype);
      EXPECT_EQ(r->o.shape,
                (std::vector<int64_t>{tokens, geometry.num_q_heads, geometry.head_dim}));
      const testing::ErrorStats e = testing::CompareOutputs(r->o.ToFloats(), out.values);
      EXPECT_TRUE(e.finite);
      EXPECT_LE(e.max_abs, max_bar);
      EXPECT_LE(e.mean_abs, mean_bar);
      worst = std::max(worst, e.max_abs);
    } else {
      ASSERT_EQ(op, "decode");
      const std::vector<int> seqs = step.at("seqs");
      const std::vector<int64_t> lens = step.at("lens_after");
      std::vector<DecodeInput> entries;
      for (size_t i = 0; i < seqs.size(); ++i) {
        DecodeInput in;
        in.sequence_id = id_of(seqs[i]);
        const std::vector<int64_t> q_shape =
            pre_rotary ? std::vector<int64_t>{geometry.num_q_heads, geometry.head_dim}
                       : std::vector<int64_t>{5, geometry.num_q_heads, geometry.head_dim};
        in.q = HostTensor::FromFloats(dtype, q_shape, testing::Rows(q.values, q_row, i, i + 1));
        in.q_layout = layout;
        in.k = HostTensor::FromFloats(dtype, {geometry.num_kv_heads, geometry.head_dim},
                                      testing::Rows(k.values, kv_row, i, i + 1));
        in.v = HostTensor::FromFloats(dtype, {geometry.num_kv_heads, geometry.head_dim},
                                      testing::Rows(v.values, kv_row, i, i + 1));
        entries.push_back(std::move(in));
      }
      absl::StatusOr<std::vector<client::DecodeResult>> r =
          use_session ? session->Decode(0, entries) : client.Decode(0, entries);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->size(), seqs.size());
      for (size_t i = 0; i < seqs.size(); ++i) {
        EXPECT_EQ((*r)[i].length, lens[i]);
        const testing::ErrorStats e = testing::CompareOutputs(
            (*r)[i].o.ToFloats(), testing::Rows(out.values, o_row, i, i + 1));
        EXPECT_TRUE(e.finite);
        EXPECT_LE(e.max_abs, max_bar) << "entry " << i;
        EXPECT_LE(e.mean_abs, mean_bar) << "entry " << i;
        worst = std::max(worst, e.max_abs);
      }
    }
    ++steps;
  }
  EXPECT_EQ(steps, static_cast<int>(c.at("steps").size()));
  std::printf("%s %s%s: %d steps, worst max abs error %.3g\n", name.c_str(),
              DTypeName(dtype).data(), use_session ? " session" : "", steps, worst);
  if (session != nullptr) {
    absl::Status closed = session->Close();
    EXPECT_TRUE(closed.ok()) << closed;
  }

  for (const std::string& id : ids) {
    absl::StatusOr<int64_t> freed = client.Release(id);
    EXPECT_TRUE(freed.ok()) << freed.status();
  }
  absl::StatusOr<v1::GetServerInfoResponse> info = client.Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->live_sequences(), 0);
  EXPECT_EQ(info->kv_cache().pages_free(), info->kv_cache().pages_total());
}

INSTANTIATE_TEST_SUITE_P(DtypesAndTransports, GoldenTest,
                         ::testing::Combine(::testing::Values(DType::kFp32, DType::kBf16),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<DType, bool>>& info) {
                           return absl::StrCat(DTypeName(std::get<0>(info.param)),
                                               std::get<1>(info.param) ? "_session" : "_unary");
                         });

}  // namespace
}  // namespace attnd
