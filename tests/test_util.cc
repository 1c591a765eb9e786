#include "tests/test_util.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "nlohmann/json.hpp"

namespace attnd {
namespace testing {

DcaGeometry ModelGeometry::dca() const {
  DcaGeometry g;
  g.num_q_heads = num_q_heads;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  g.chunk_len = chunk_len();
  g.original_max_position_embeddings = original_max_position_embeddings;
  g.softmax_scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  return g;
}

absl::StatusOr<std::string> WriteModelConfig(const ModelGeometry& geometry) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", geometry.name, "-",
                                        getpid(), "-", counter++, ".json");
  nlohmann::json config = {
      {"_name_or_path", geometry.name},
      {"num_hidden_layers", geometry.num_layers},
      {"num_attention_heads", geometry.num_q_heads},
      {"num_key_value_heads", geometry.num_kv_heads},
      {"head_dim", geometry.head_dim},
      {"hidden_size", geometry.num_q_heads * geometry.head_dim},
      {"max_position_embeddings", geometry.max_position_embeddings},
      {"rope_theta", geometry.rope_theta},
      {"dual_chunk_attention_config",
       {{"chunk_size", geometry.chunk_size},
        {"local_size", geometry.local_size},
        {"original_max_position_embeddings", geometry.original_max_position_embeddings}}},
  };
  std::ofstream out(path);
  out << config.dump(2) << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return path;
}

ServerOptions SmallCpuOptions() {
  ServerOptions options;
  options.device = "cpu";
  options.kv_dtype = "fp32";
  options.kv_cache_bytes = 16ll << 20;
  options.compute_threads = 2;
  return options;
}

absl::StatusOr<std::unique_ptr<TestDaemon>> TestDaemon::Start(const ModelGeometry& geometry,
                                                              ServerOptions options) {
  absl::StatusOr<std::string> config = WriteModelConfig(geometry);
  if (!config.ok()) return config.status();
  options.model_config = *config;
  options.listen = "127.0.0.1:0";
  std::unique_ptr<TestDaemon> daemon(new TestDaemon());
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(options);
  if (!server.ok()) return server.status();
  daemon->server_ = std::move(*server);
  absl::StatusOr<std::unique_ptr<client::AttndClient>> client = daemon->NewClient();
  if (!client.ok()) return client.status();
  daemon->client_ = std::move(*client);
  return daemon;
}

TestDaemon::~TestDaemon() {
  client_.reset();
  if (server_ != nullptr) {
    server_->Shutdown(absl::Now() + absl::Seconds(5));
    server_->Wait();
  }
}

std::string TestDaemon::target() const { return absl::StrCat("127.0.0.1:", server_->port()); }

absl::StatusOr<std::unique_ptr<client::AttndClient>> TestDaemon::NewClient() const {
  client::ClientOptions options;
  // Larger than any server limit used in tests, so oversized requests are judged by the server.
  options.max_message_bytes = 1ll << 30;
  options.rpc_timeout = absl::Seconds(60);
  return client::AttndClient::Connect(target(), options);
}

std::vector<float> RandomInputs(std::mt19937* rng, int64_t n) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> values(n);
  for (float& x : values) x = Bf16ToFloat(FloatToBf16(dist(*rng)));
  return values;
}

ErrorStats CompareOutputs(absl::Span<const float> actual, absl::Span<const float> expected) {
  ErrorStats stats;
  if (actual.size() != expected.size() || actual.empty()) {
    stats.max_abs = std::numeric_limits<double>::infinity();
    stats.mean_abs = stats.max_abs;
    return stats;
  }
  double sum = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) stats.finite = false;
    const double err = std::fabs(static_cast<double>(actual[i]) - expected[i]);
    // NaN compares false: make it the worst error so a NaN can never pass a bound.
    if (!(err <= stats.max_abs)) stats.max_abs = std::isnan(err) ? INFINITY : err;
    sum += std::isnan(err) ? INFINITY : err;
  }
  stats.mean_abs = sum / actual.size();
  return stats;
}

std::vector<float> Rows(absl::Span<const float> values, int64_t row_elems, int64_t begin,
                        int64_t end) {
  return std::vector<float>(values.begin() + begin * row_elems, values.begin() + end * row_elems);
}

}  // namespace testing
}  // namespace attnd
