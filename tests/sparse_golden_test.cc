// Replays the golden case sparse_vs (tests/testdata/dca: vertical-slash sparse prefill of 1100
// tokens over three DCA chunks, then dense decode) through a daemon over loopback gRPC. The model
// folder is written to a temp dir as a Hugging Face folder would hold it: config.json plus
// sparse_attention_config.json with the case's per-head budgets. fp32 must match the golden
// outputs within 1e-4, bf16 within DCA.md's bars; with sparse_attention_enabled false in
// config.json the same prompt runs dense and must not match (the case is sparse-sensitive).
//
// sparse_golden_cuda_test builds this file with ATTND_GOLDEN_ON_CUDA: the same replay against the
// CUDA backend's sparse kernels (bf16 K/V on the device, so both request dtypes are held to
// DCA.md's bf16 bars). It skips loudly where no CUDA device is present.
#include <sys/stat.h>
#include <unistd.h>

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
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/rpc/server.h"
#include "tests/test_util.h"
#include "tests/testdata/golden_dir.h"

#ifdef ATTND_GOLDEN_ON_CUDA
#include "server/engine/cuda_engine.h"
constexpr bool kOnCuda = true;
#else
constexpr bool kOnCuda = false;
#endif

namespace attnd {
namespace {

using client::DecodeInput;
using client::HostTensor;

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

class GoldenCase {
 public:
  bool Load(const std::string& dir) {
    std::ifstream json_file(dir + "/case.json");
    if (!json_file) return false;
    json_ = nlohmann::json::parse(json_file, nullptr, /*allow_exceptions=*/false);
    if (json_.is_discarded()) return false;
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
    t.shape = entry.at("shape").get<std::vector<int64_t>>();
    const DType dtype = entry.at("dtype") == "bf16" ? DType::kBf16 : DType::kFp32;
    const size_t n = entry.at("nbytes").get<size_t>() / ElementSize(dtype);
    t.values.resize(n);
    ConvertToFloat(blob_.data() + entry.at("offset").get<size_t>(), dtype, n, t.values.data());
    return t;
  }

 private:
  nlohmann::json json_;
  std::string blob_;
};

// Writes the case's model folder (config.json + sparse_attention_config.json) into a fresh temp
// dir and returns the config.json path. enabled: the value of sparse_attention_enabled to write,
// or absent (the file alone turns sparse on).
std::string WriteModelFolder(const nlohmann::json& c, const char* enabled) {
  static int counter = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/sparse_vs-", getpid(), "-", counter++);
  mkdir(dir.c_str(), 0755);
  const nlohmann::json& dca = c.at("dual_chunk_attention_config");
  nlohmann::json dca_out = {
      {"chunk_size", dca.at("chunk_size")},
      {"local_size", dca.at("local_size")},
      {"original_max_position_embeddings", dca.at("original_max_position_embeddings")},
      {"sparse_attention_threshold", dca.at("sparse_attention_threshold")},
      {"sparse_attention_last_q", dca.at("sparse_attention_last_q")},
  };
  if (enabled != nullptr) dca_out["sparse_attention_enabled"] = std::string(enabled) == "true";
  const int64_t hq = c.at("num_q_heads"), d = c.at("head_dim");
  const nlohmann::json config = {
      {"_name_or_path", "golden-sparse-vs"},
      {"num_hidden_layers",
       c.at("dual_chunk_attention_config").at("sparse_attention_config").size()},
      {"num_attention_heads", hq},
      {"num_key_value_heads", c.at("num_kv_heads")},
      {"head_dim", d},
      {"hidden_size", hq * d},
      {"max_position_embeddings", 8192},
      {"dual_chunk_attention_config", dca_out},
  };
  std::ofstream(dir + "/config.json") << config.dump(2) << "\n";
  std::ofstream(dir + "/sparse_attention_config.json")
      << dca.at("sparse_attention_config").dump(1) << "\n";
  return dir + "/config.json";
}

struct Daemon {
  std::unique_ptr<AttndServer> server;
  std::unique_ptr<client::AttndClient> client;
  ~Daemon() {
    client.reset();
    if (server != nullptr) {
      server->Shutdown(absl::Now() + absl::Seconds(5));
      server->Wait();
    }
  }
};

absl::Status StartDaemon(const std::string& config_path, const std::string& kv_dtype,
                         Daemon* daemon) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.model_config = config_path;
  options.page_size = 16;
  options.device = kOnCuda ? "cuda" : "cpu";
  options.kv_dtype = kOnCuda ? "bf16" : kv_dtype;
  options.kv_cache_bytes = 32ll << 20;
  options.compute_threads = 2;
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(options);
  if (!server.ok()) return server.status();
  daemon->server = *std::move(server);
  client::ClientOptions client_options;
  client_options.max_message_bytes = 1ll << 30;
  client_options.rpc_timeout = absl::Seconds(120);
  absl::StatusOr<std::unique_ptr<client::AttndClient>> client = client::AttndClient::Connect(
      absl::StrCat("127.0.0.1:", daemon->server->port()), client_options);
  if (!client.ok()) return client.status();
  daemon->client = *std::move(client);
  return absl::OkStatus();
}

class SparseGoldenTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
#ifdef ATTND_GOLDEN_ON_CUDA
    if (CudaDeviceCount() == 0) {
      std::fprintf(stderr, "*** SKIPPING GPU TEST: sparse_golden_cuda_test: no CUDA device ***\n");
      GTEST_SKIP() << "no CUDA device: sparse_golden_cuda_test runs on a GPU machine "
                      "(docs/BENCHMARKS.md)";
    }
#endif
    const std::string dir = testing::GoldenCaseDir("sparse_vs");
    ASSERT_TRUE(golden_.Load(dir))
        << "cannot read the golden case in " << dir << " (//tests/testdata:dca in the test's data)";
    ASSERT_FLOAT_EQ(golden_.json().at("softmax_scale").get<float>(),
                    1.f / std::sqrt(golden_.json().at("head_dim").get<float>()))
        << "the case's softmax scale is not 1/sqrt(head_dim); a config.json cannot express it";
  }
  GoldenCase golden_;
};

TEST_P(SparseGoldenTest, SparseVs) {
  const DType dtype = GetParam();
  const nlohmann::json& c = golden_.json();
  const nlohmann::json& dca = c.at("dual_chunk_attention_config");
  Daemon daemon;
  // bf16 requests also keep bf16 KV: the case's inputs are exact in bf16, so the selection is the
  // same and only the outputs' rounding differs.
  const absl::Status started =
      StartDaemon(WriteModelFolder(c, nullptr), dtype == DType::kFp32 ? "fp32" : "bf16", &daemon);
  ASSERT_TRUE(started.ok()) << started;
  client::AttndClient& client = *daemon.client;

  absl::StatusOr<v1::GetServerInfoResponse> info = client.Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->dca().sparse_attention_enabled());
  EXPECT_EQ(info->dca().sparse_attention_threshold(),
            dca.at("sparse_attention_threshold").get<int64_t>());
  EXPECT_EQ(info->dca().sparse_attention_last_q(),
            dca.at("sparse_attention_last_q").get<int64_t>());

  const int64_t hq = c.at("num_q_heads"), hkv = c.at("num_kv_heads"), d = c.at("head_dim");
  const bool exact = dtype == DType::kFp32 && !kOnCuda;
  const double max_bar = exact ? 1e-4 : 2e-2;
  const double mean_bar = exact ? 1e-4 : 2e-3;
  absl::StatusOr<std::string> id = client.CreateSequence();
  ASSERT_TRUE(id.ok()) << id.status();
  int steps = 0;
  double worst = 0;
  for (const nlohmann::json& step : c.at("steps")) {
    const std::string op = step.at("op");
    SCOPED_TRACE(absl::StrCat("step ", steps, " (", op, ")"));
    ASSERT_EQ(step.contains("seq") ? step.at("seq").get<int>() : step.at("seqs").at(0).get<int>(),
              0);
    const Tensor q = golden_.Get(step.at("q"));
    const Tensor k = golden_.Get(step.at("k"));
    const Tensor v = golden_.Get(step.at("v"));
    const Tensor out = golden_.Get(step.at("out"));
    std::vector<float> got;
    if (op == "prefill") {
      const int64_t t = step.at("tokens");
      absl::StatusOr<client::PrefillResult> r =
          client.Prefill(*id, 0, HostTensor::FromFloats(dtype, {t, 5, hq, d}, q.values),
                         HostTensor::FromFloats(dtype, {t, hkv, d}, k.values),
                         HostTensor::FromFloats(dtype, {t, hkv, d}, v.values),
                         step.at("prompt_len").get<int64_t>());
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->length, step.at("start").get<int64_t>() + t);
      got = r->o.ToFloats();
    } else {
      ASSERT_EQ(op, "decode");
      DecodeInput in;
      in.sequence_id = *id;
      in.q = HostTensor::FromFloats(dtype, {5, hq, d}, q.values);
      in.k = HostTensor::FromFloats(dtype, {hkv, d}, k.values);
      in.v = HostTensor::FromFloats(dtype, {hkv, d}, v.values);
      std::vector<DecodeInput> entries;
      entries.push_back(std::move(in));
      absl::StatusOr<std::vector<client::DecodeResult>> r = client.Decode(0, entries);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->size(), 1u);
      EXPECT_EQ((*r)[0].length, step.at("lens_after").at(0).get<int64_t>());
      got = (*r)[0].o.ToFloats();
    }
    const testing::ErrorStats e = testing::CompareOutputs(got, out.values);
    EXPECT_TRUE(e.finite);
    EXPECT_LE(e.max_abs, max_bar);
    EXPECT_LE(e.mean_abs, mean_bar);
    worst = std::max(worst, e.max_abs);
    ++steps;
  }
  EXPECT_EQ(steps, static_cast<int>(c.at("steps").size()));
  std::printf("%s: %d steps, worst max abs error %.3g\n", DTypeName(dtype).data(), steps, worst);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SparseGoldenTest, ::testing::Values(DType::kFp32, DType::kBf16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

// The same prompt with sparse_attention_enabled false in config.json: the daemon reports sparse
// off and runs dense, which the sparse golden outputs must not match -- so the case above really
// exercises the sparse path.
TEST_F(SparseGoldenTest, DisabledInConfigRunsDense) {
  const nlohmann::json& c = golden_.json();
  Daemon daemon;
  const absl::Status started = StartDaemon(WriteModelFolder(c, "false"), "fp32", &daemon);
  ASSERT_TRUE(started.ok()) << started;
  absl::StatusOr<v1::GetServerInfoResponse> info = daemon.client->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->dca().sparse_attention_enabled());

  const nlohmann::json& step = c.at("steps").at(0);
  ASSERT_EQ(step.at("op"), "prefill");
  const int64_t hq = c.at("num_q_heads"), hkv = c.at("num_kv_heads"), d = c.at("head_dim");
  const int64_t t = step.at("tokens");
  absl::StatusOr<std::string> id = daemon.client->CreateSequence();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<client::PrefillResult> r = daemon.client->Prefill(
      *id, 0, HostTensor::FromFloats(DType::kFp32, {t, 5, hq, d}, golden_.Get(step.at("q")).values),
      HostTensor::FromFloats(DType::kFp32, {t, hkv, d}, golden_.Get(step.at("k")).values),
      HostTensor::FromFloats(DType::kFp32, {t, hkv, d}, golden_.Get(step.at("v")).values),
      step.at("prompt_len").get<int64_t>());
  ASSERT_TRUE(r.ok()) << r.status();
  const testing::ErrorStats e =
      testing::CompareOutputs(r->o.ToFloats(), golden_.Get(step.at("out")).values);
  EXPECT_TRUE(e.finite);
  EXPECT_GT(e.max_abs, 1e-2) << "dense attention matched the sparse golden outputs";
}

}  // namespace
}  // namespace attnd
