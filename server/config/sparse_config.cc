#include "server/config/sparse_config.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace attnd {
namespace {

using json = nlohmann::json;

// The 7B pattern file is ~60 KiB; refuse anything that is clearly not one.
constexpr int64_t kMaxPatternBytes = 64 << 20;
constexpr size_t kMaxQuotedChars = 80;
constexpr char kPatternType[] = "vertical_and_slash";
// The reference reads a vertical budget equal to its 30 forced sink columns as 130, so that such
// heads still get 100 data-driven columns.
constexpr int64_t kSinkOnlyVertical = 30;
constexpr int64_t kSinkOnlyVerticalReadAs = 130;

std::string Quote(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > kMaxQuotedChars) {
    text.resize(kMaxQuotedChars);
    text += "...";
  }
  return text;
}

// A JSON integer >= 1 (not a float, not a bool).
bool PositiveInt(const json& v, int64_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return false;
    }
  }
  *out = v.get<int64_t>();
  return *out >= 1;
}

}  // namespace

absl::StatusOr<std::vector<VsBudget>> ParseSparsePattern(absl::string_view text,
                                                         absl::string_view source,
                                                         int32_t num_layers, int32_t num_q_heads) {
  auto error = [&](absl::string_view where, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", where, what));
  };
  const json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return error("", "not valid JSON");
  if (!root.is_array()) {
    return error("", absl::StrCat("expected a list of per-layer objects, got ", Quote(root)));
  }
  if (root.size() != static_cast<size_t>(num_layers)) {
    return error("", absl::StrCat("has ", root.size(), " layers, the model has ", num_layers));
  }
  std::vector<VsBudget> budgets(static_cast<size_t>(num_layers) * num_q_heads);
  for (int32_t layer = 0; layer < num_layers; ++layer) {
    const json& heads = root[layer];
    const std::string where_layer = absl::StrCat("layer ", layer);
    if (!heads.is_object()) {
      return error(where_layer, absl::StrCat(": expected an object of heads, got ", Quote(heads)));
    }
    if (heads.size() != static_cast<size_t>(num_q_heads)) {
      return error(where_layer, absl::StrCat(" has ", heads.size(), " heads, the model has ",
                                             num_q_heads, " q heads"));
    }
    std::vector<bool> seen(num_q_heads, false);
    for (auto it = heads.begin(); it != heads.end(); ++it) {
      const std::string& key = it.key();
      const std::string where = absl::StrCat(where_layer, " head \"", key, "\"");
      int64_t head = -1;
      if (key.empty() || !absl::ascii_isdigit(static_cast<unsigned char>(key[0])) ||
          !absl::SimpleAtoi(key, &head) || head < 0 || head >= num_q_heads) {
        return error(where, absl::StrCat(": not a q head index in [0, ", num_q_heads, ")"));
      }
      if (seen[head]) return error(where, ": listed twice");
      seen[head] = true;
      const json& entry = it.value();
      if (!entry.is_array() || entry.size() != 4) {
        return error(where,
                     absl::StrCat(": expected [\"", kPatternType,
                                  "\", vertical_size, slash_size, score], got ", Quote(entry)));
      }
      if (!entry[0].is_string()) {
        return error(where, absl::StrCat(": pattern type must be a string, got ", Quote(entry[0])));
      }
      if (entry[0].get<std::string>() != kPatternType) {
        return error(where, absl::StrCat(": unknown pattern type ", Quote(entry[0]), " (only \"",
                                         kPatternType, "\" is supported)"));
      }
      int64_t vertical = 0, slash = 0;
      if (!PositiveInt(entry[1], &vertical)) {
        return error(where, absl::StrCat(": vertical_size must be a positive integer, got ",
                                         Quote(entry[1])));
      }
      if (!PositiveInt(entry[2], &slash)) {
        return error(
            where, absl::StrCat(": slash_size must be a positive integer, got ", Quote(entry[2])));
      }
      if (!entry[3].is_number()) {
        return error(where, absl::StrCat(": score must be a number, got ", Quote(entry[3])));
      }
      VsBudget& b = budgets[static_cast<size_t>(layer) * num_q_heads + head];
      b.vertical = vertical == kSinkOnlyVertical ? kSinkOnlyVerticalReadAs : vertical;
      b.slash = slash;
    }
  }
  return budgets;
}

absl::StatusOr<std::optional<SparseAttentionConfig>> LoadSparseAttentionConfig(
    const std::string& model_dir, int32_t num_layers, int32_t num_q_heads,
    const SparseSettings& settings) {
  const std::string file = absl::StrCat(model_dir.empty() ? "." : model_dir,
                                        !model_dir.empty() && model_dir.back() == '/' ? "" : "/",
                                        kSparseAttentionConfigFile);
  struct stat st;
  if (stat(file.c_str(), &st) != 0) {
    const int err = errno;
    if (err != ENOENT && err != ENOTDIR) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": cannot read the sparse attention config: ", std::strerror(err)));
    }
    if (settings.enabled.value_or(false)) {
      return absl::InvalidArgumentError(
          absl::StrCat("dual_chunk_attention_config.sparse_attention_enabled is true but ", file,
                       " does not exist; sparse prefill needs its per-head budgets"));
    }
    return std::optional<SparseAttentionConfig>();
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": cannot read the sparse attention config: not a regular file"));
  }
  if (st.st_size > kMaxPatternBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": ", st.st_size, " bytes is too large (limit ", kMaxPatternBytes, ")"));
  }
  std::ifstream in(file, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": cannot read the sparse attention config"));
  }
  absl::StatusOr<std::vector<VsBudget>> budgets =
      ParseSparsePattern(text.str(), file, num_layers, num_q_heads);
  if (!budgets.ok()) return budgets.status();
  SparseAttentionConfig config;
  config.source = file;
  config.num_layers = num_layers;
  config.num_q_heads = num_q_heads;
  config.budgets = *std::move(budgets);
  config.enabled = settings.enabled.value_or(true);
  config.threshold = settings.threshold;
  config.last_q = settings.last_q;
  return std::optional<SparseAttentionConfig>(std::move(config));
}

}  // namespace attnd
