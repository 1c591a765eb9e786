// The vertical-slash sparse prefill settings of a model (docs/DCA.md "Vertical-slash sparse
// prefill"): the per-layer, per-head budgets of sparse_attention_config.json, which Hugging Face
// model folders keep beside config.json, plus dual_chunk_attention_config's
// sparse_attention_enabled / sparse_attention_threshold / sparse_attention_last_q.
//
// The file is a list over layers of {"<head>": ["vertical_and_slash", vertical_size, slash_size,
// score]}; vertical_size 30 is read as 130 (the reference's rule). When the file exists sparse
// prefill is on unless config.json sets sparse_attention_enabled to false; it is taken for a
// prompt strictly longer than the threshold.
#ifndef ATTND_SERVER_CONFIG_SPARSE_CONFIG_H_
#define ATTND_SERVER_CONFIG_SPARSE_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/vertical_slash.h"

namespace attnd {

inline constexpr char kSparseAttentionConfigFile[] = "sparse_attention_config.json";

struct SparseAttentionConfig {
  std::string source;  // the file the budgets came from
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  std::vector<VsBudget> budgets;  // [num_layers][num_q_heads], vertical 30 already read as 130
  bool enabled = false;
  int64_t threshold = 0;  // sparse only for prompt_len > threshold
  int64_t last_q = 0;     // queries per piece that estimate the pattern (>= 1)

  // The budgets of one layer's q heads ([num_q_heads]); layer must be in [0, num_layers).
  absl::Span<const VsBudget> layer(int32_t layer) const {
    return absl::MakeConstSpan(budgets.data() + static_cast<size_t>(layer) * num_q_heads,
                               num_q_heads);
  }
  // Whether a prefill whose prompt (as defined for length scaling) has prompt_len tokens takes
  // the sparse path.
  bool UseSparse(int64_t prompt_len) const { return enabled && prompt_len > threshold; }
};

// Parses sparse_attention_config.json text into per-layer, per-head budgets [layers][heads].
// INVALID_ARGUMENT, prefixed with `source` and naming the layer and head, for text that is not
// JSON, a top level that is not a list of num_layers objects, a missing / extra / non-numeric
// head key, an entry that is not ["vertical_and_slash", int >= 1, int >= 1, number], or an
// unknown pattern type.
absl::StatusOr<std::vector<VsBudget>> ParseSparsePattern(absl::string_view text,
                                                         absl::string_view source,
                                                         int32_t num_layers, int32_t num_q_heads);

// What config.json says about sparse prefill (server/config/model_config.h parses it).
struct SparseSettings {
  std::optional<bool> enabled;  // sparse_attention_enabled when the key is present
  int64_t threshold = 32768;
  int64_t last_q = 64;
};

// Reads `<model_dir>/sparse_attention_config.json`. nullopt when the file does not exist and
// config.json does not ask for sparse; INVALID_ARGUMENT when it asks for it (enabled true)
// without the file, or when the file cannot be read or is malformed (ParseSparsePattern).
absl::StatusOr<std::optional<SparseAttentionConfig>> LoadSparseAttentionConfig(
    const std::string& model_dir, int32_t num_layers, int32_t num_q_heads,
    const SparseSettings& settings);

}  // namespace attnd

#endif  // ATTND_SERVER_CONFIG_SPARSE_CONFIG_H_
