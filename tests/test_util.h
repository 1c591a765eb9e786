// Shared pieces of the cross-package tests: an in-process attnd on 127.0.0.1:0 with a model
// config written from a geometry, a connected client, random inputs and error statistics.
#ifndef ATTND_TESTS_TEST_UTIL_H_
#define ATTND_TESTS_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/attnd_client.h"
#include "kernels/dca.h"
#include "server/rpc/server.h"

namespace attnd {
namespace testing {

// The keys of a Hugging Face config.json that attnd reads.
struct ModelGeometry {
  std::string name = "test-model";
  int32_t num_layers = 2;
  int32_t num_q_heads = 4;
  int32_t num_kv_heads = 2;
  int32_t head_dim = 64;
  int64_t max_position_embeddings = 4096;
  int64_t chunk_size = 160;
  int64_t local_size = 32;
  int64_t original_max_position_embeddings = 256;
  double rope_theta = 10000.0;  // written as config.json's rope_theta

  int64_t chunk_len() const { return chunk_size - local_size; }
  DcaGeometry dca() const;  // softmax_scale = 1/sqrt(head_dim)
  int64_t q_elems_per_token() const { return 5ll * num_q_heads * head_dim; }
  int64_t kv_elems_per_token() const { return int64_t{num_kv_heads} * head_dim; }
  int64_t o_elems_per_token() const { return int64_t{num_q_heads} * head_dim; }
};

// Writes `geometry` as a config.json into a fresh file under $TEST_TMPDIR (or /tmp).
absl::StatusOr<std::string> WriteModelConfig(const ModelGeometry& geometry);

// The CPU backend with an fp32 pool of 16 MiB and two compute threads: what most tests start.
ServerOptions SmallCpuOptions();

// A daemon started in-process plus a client connected to it. Shuts the server down on destruction.
class TestDaemon {
 public:
  // Fills in options.model_config (written from `geometry`) and options.listen (127.0.0.1:0).
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start(const ModelGeometry& geometry,
                                                           ServerOptions options);
  ~TestDaemon();

  client::AttndClient& client() { return *client_; }
  AttndServer& server() { return *server_; }
  std::string target() const;
  // A second, independent connection (its own channel).
  absl::StatusOr<std::unique_ptr<client::AttndClient>> NewClient() const;

 private:
  std::unique_ptr<AttndServer> server_;
  std::unique_ptr<client::AttndClient> client_;
};

// n values uniform in [-1, 1), already rounded to bf16 so every dtype carries them exactly
// (outputs then differ from the reference only by the kernel's and the output's rounding).
std::vector<float> RandomInputs(std::mt19937* rng, int64_t n);

struct ErrorStats {
  double max_abs = 0;
  double mean_abs = 0;
  bool finite = true;
};
// |actual - expected| elementwise; sizes must match (a mismatch reports max_abs = +inf).
ErrorStats CompareOutputs(absl::Span<const float> actual, absl::Span<const float> expected);

// Rows [begin, end) of a row-major tensor whose rows have `row_elems` elements.
std::vector<float> Rows(absl::Span<const float> values, int64_t row_elems, int64_t begin,
                        int64_t end);

}  // namespace testing
}  // namespace attnd

#endif  // ATTND_TESTS_TEST_UTIL_H_
