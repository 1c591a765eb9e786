// The served model's attention geometry and DCA settings, read from a Hugging Face config.json
// (the file the model ships with) or the embedded Qwen2.5-7B-Instruct-1M default. Everything else
// (engine, runtime, service) reads the model through this struct.
#ifndef ATTND_SERVER_CONFIG_MODEL_CONFIG_H_
#define ATTND_SERVER_CONFIG_MODEL_CONFIG_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/dca.h"
#include "server/config/sparse_config.h"

namespace attnd {

// Defaults for absent dual_chunk_attention_config keys (DCA.md, "Model constants"; the same as
// the SGLang and vLLM backends).
inline constexpr int64_t kDefaultChunkSize = 8192;
inline constexpr int64_t kDefaultLocalSize = 1024;
inline constexpr int64_t kDefaultOriginalMaxPositionEmbeddings = 0;  // no length scaling
inline constexpr int64_t kDefaultSparseAttentionThreshold = 32768;
inline constexpr int64_t kDefaultSparseAttentionLastQ = 64;
// Hugging Face's Qwen2Config default when config.json has no rope_theta.
inline constexpr double kDefaultRopeTheta = 10000.0;

struct ModelConfig {
  std::string name;                     // "_name_or_path", else the config's directory or stem
  int32_t num_layers = 0;               // num_hidden_layers
  int32_t num_q_heads = 0;              // num_attention_heads
  int32_t num_kv_heads = 0;             // num_key_value_heads (default: num_attention_heads)
  int32_t head_dim = 0;                 // head_dim, or hidden_size / num_attention_heads
  int64_t max_position_embeddings = 0;  // the longest sequence the model supports
  // dual_chunk_attention_config, defaults applied:
  int64_t chunk_size = kDefaultChunkSize;
  int64_t local_size = kDefaultLocalSize;
  int64_t original_max_position_embeddings = kDefaultOriginalMaxPositionEmbeddings;
  // Vertical-slash sparse prefill. In Hugging Face model folders the per-head budgets live in
  // sparse_attention_config.json beside config.json; LoadModelConfig reads it into `sparse` and
  // turns sparse on unless config.json sets "sparse_attention_enabled": false
  // (server/config/sparse_config.h). ParseModelConfig alone sees only config.json's keys.
  bool sparse_attention_enabled = false;
  bool sparse_attention_enabled_set = false;  // config.json has the key
  int64_t sparse_attention_threshold = kDefaultSparseAttentionThreshold;
  int64_t sparse_attention_last_q = kDefaultSparseAttentionLastQ;
  std::shared_ptr<const SparseAttentionConfig> sparse;  // the budgets, when the file was found
  float softmax_scale = 0.f;                            // 1/sqrt(head_dim)
  // The rotary embedding (neox style, as Qwen2), applied by attnd to pre-rotary requests
  // (docs/rotary.md):
  double rope_theta = kDefaultRopeTheta;  // rope_theta
  float partial_rotary_factor = 1.f;      // partial_rotary_factor, in (0, 1]
  int32_t rotary_dim = 0;                 // int(head_dim * partial_rotary_factor), even, >= 2

  // What the operator should know about how the config was read, e.g. that it has no
  // dual_chunk_attention_config and which defaults were used. LoadModelConfig logs each with
  // spdlog::warn; ParseModelConfig only fills them in.
  std::vector<std::string> warnings;

  // chunk_size - local_size: the distance between DCA chunk boundaries ("cl").
  int64_t chunk_len() const { return chunk_size - local_size; }
  DcaGeometry geometry() const;
};

// Reads a Hugging Face config.json (or a model directory holding one), and the
// sparse_attention_config.json beside it when there is one. NOT_FOUND naming the path when it does
// not exist; INVALID_ARGUMENT naming the file (and the key or entry, and what was expected) when
// either file cannot be read, is not JSON, or describes an impossible model, and when config.json
// enables sparse attention without the pattern file.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// Parses config.json text. `source_name` (a path or a label) prefixes every error message and
// names the model when the JSON has no "_name_or_path".
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view text, absl::string_view source_name);

// Qwen2.5-7B-Instruct-1M (DCA.md "Model constants"): the model served when no config is given.
ModelConfig Qwen25_7BInstruct1M();

}  // namespace attnd

#endif  // ATTND_SERVER_CONFIG_MODEL_CONFIG_H_
