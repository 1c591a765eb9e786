// libFuzzer target: the config loaders. Byte 0 picks ParseModelConfig (config.json) or
// ParseSparsePattern (sparse_attention_config.json, for 1-3 layers and 1-4 heads from byte 1);
// the rest is the file's text. A success must describe a usable model / one budget per layer and
// head; a failure must be INVALID_ARGUMENT with a message naming the source.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/harness.h"
#include "server/config/model_config.h"
#include "server/config/sparse_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);
  if (data[0] % 2 == 0) {
    absl::StatusOr<attnd::ModelConfig> m = attnd::ParseModelConfig(text, "fuzz.json");
    if (m.ok()) {
      ATTND_FUZZ_CHECK(m->num_layers > 0 && m->num_q_heads > 0 && m->num_kv_heads > 0 &&
                           m->head_dim > 0 && m->num_q_heads % m->num_kv_heads == 0,
                       "accepted heads/layers %d %d %d %d", m->num_layers, m->num_q_heads,
                       m->num_kv_heads, m->head_dim);
      ATTND_FUZZ_CHECK(m->chunk_len() > 0 && m->local_size >= 0 && m->max_position_embeddings > 0,
                       "accepted chunk_size %lld local_size %lld max %lld",
                       static_cast<long long>(m->chunk_size), static_cast<long long>(m->local_size),
                       static_cast<long long>(m->max_position_embeddings));
      ATTND_FUZZ_CHECK(m->softmax_scale > 0, "softmax_scale %f", m->softmax_scale);
    } else {
      ATTND_FUZZ_CHECK(m.status().code() == absl::StatusCode::kInvalidArgument, "code %d: %s",
                       static_cast<int>(m.status().code()),
                       std::string(m.status().message()).c_str());
      ATTND_FUZZ_CHECK(m.status().message().find("fuzz.json") != absl::string_view::npos,
                       "message does not name the file: %s",
                       std::string(m.status().message()).c_str());
    }
  } else {
    const int32_t layers = 1 + data[1] % 3, heads = 1 + (data[1] / 3) % 4;
    auto p = attnd::ParseSparsePattern(text, "sparse.json", layers, heads);
    if (p.ok()) {
      ATTND_FUZZ_CHECK(static_cast<int64_t>(p->size()) == int64_t{layers} * heads,
                       "%zu budgets for %d x %d", p->size(), layers, heads);
    } else {
      ATTND_FUZZ_CHECK(
          p.status().code() == absl::StatusCode::kInvalidArgument && !p.status().message().empty(),
          "code %d: %s", static_cast<int>(p.status().code()),
          std::string(p.status().message()).c_str());
    }
  }
  return 0;
}
