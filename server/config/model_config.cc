#include "server/config/model_config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace attnd {
namespace {

using json = nlohmann::json;

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// A config.json is a few KiB; refuse to slurp something that is clearly not one.
constexpr int64_t kMaxConfigBytes = 16 << 20;
// How much of an offending value an error message quotes.
constexpr size_t kMaxQuotedValueChars = 80;

// The value as JSON text ("abc" keeps its quotes, so strings and numbers are told apart).
std::string Quote(const json& value) {
  // `replace` so a stray invalid UTF-8 byte can never make dump() throw.
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > kMaxQuotedValueChars) {
    text.resize(kMaxQuotedValueChars);
    text += "...";
  }
  return text;
}

// Finds where text stops being JSON. json::parse(.., false) only says "discarded"; the SAX
// interface hands the parse error over as a value, so nothing is thrown here either.
class ParseErrorLocator : public nlohmann::json_sax<json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    // what() is "[json.exception.parse_error.101] parse error at line 1, column 2: ...".
    absl::string_view what = ex.what();
    const size_t bracket = what.find("] ");
    if (absl::StartsWith(what, "[") && bracket != absl::string_view::npos) {
      what.remove_prefix(bracket + 2);
    }
    error_ = std::string(what);
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

// The model's name when config.json does not carry "_name_or_path": the directory of a
// "config.json" (what people call the model), else the file's stem.
std::string NameFromSource(absl::string_view source) {
  while (absl::EndsWith(source, "/")) source.remove_suffix(1);
  absl::string_view base = source;
  absl::string_view dir;
  if (const size_t slash = source.rfind('/'); slash != absl::string_view::npos) {
    base = source.substr(slash + 1);
    dir = source.substr(0, slash);
  }
  if (base == "config.json" && !dir.empty()) {
    const size_t slash = dir.rfind('/');
    return std::string(slash == absl::string_view::npos ? dir : dir.substr(slash + 1));
  }
  if (absl::EndsWith(base, ".json")) base.remove_suffix(5);
  return std::string(base);
}

// Typed access to one JSON object with error messages of the form
// "<source>: <prefix><key> must be <what>, got <value>".
class ObjectReader {
 public:
  ObjectReader(const json& object, absl::string_view source, absl::string_view prefix)
      : object_(object), source_(source), prefix_(prefix) {}

  // nullptr when the key is absent or null (Hugging Face writes null for "unset").
  const json* Get(absl::string_view key) const {
    auto it = object_.find(std::string(key));
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::Status Error(absl::string_view key, absl::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", prefix_, key, " ", message));
  }

  // An integer in [min, max] (min is 0 or 1); nullopt when absent and not required.
  absl::StatusOr<std::optional<int64_t>> Int(absl::string_view key, int64_t min, int64_t max,
                                             bool required) const {
    const char* expected = min > 0 ? "a positive integer" : "a non-negative integer";
    const json* value = Get(key);
    if (value == nullptr) {
      if (!required) return std::optional<int64_t>();
      return Error(key, absl::StrCat("is missing; expected ", expected));
    }
    if (value->is_number_integer()) {  // true for unsigned ones too; false for 2.0 and true
      // nlohmann keeps non-negative integers unsigned, so a value above INT64_MAX still parses.
      const bool too_big = value->is_number_unsigned()
                               ? value->get<uint64_t>() > static_cast<uint64_t>(max)
                               : value->get<int64_t>() > max;
      if (too_big) {
        return Error(key, absl::StrCat("must be at most ", max, ", got ", Quote(*value)));
      }
      const int64_t v = value->get<int64_t>();
      if (v >= min) return std::optional<int64_t>(v);
    }
    return Error(key, absl::StrCat("must be ", expected, ", got ", Quote(*value)));
  }

  absl::StatusOr<int64_t> IntOr(absl::string_view key, int64_t min, int64_t max,
                                int64_t fallback) const {
    ATTND_ASSIGN_OR_RETURN(std::optional<int64_t> v, Int(key, min, max, /*required=*/false));
    return v.value_or(fallback);
  }

  absl::StatusOr<int64_t> RequiredInt(absl::string_view key, int64_t min, int64_t max) const {
    ATTND_ASSIGN_OR_RETURN(std::optional<int64_t> v, Int(key, min, max, /*required=*/true));
    return *v;
  }

  // A finite number greater than `min_exclusive` and at most `max` (integers count as numbers);
  // `expected` says so in the error.
  absl::StatusOr<double> NumberOr(absl::string_view key, double min_exclusive, double max,
                                  absl::string_view expected, double fallback) const {
    const json* value = Get(key);
    if (value == nullptr) return fallback;
    if (value->is_number()) {
      const double v = value->get<double>();
      if (std::isfinite(v) && v > min_exclusive && v <= max) return v;
    }
    return Error(key, absl::StrCat("must be ", expected, ", got ", Quote(*value)));
  }

  absl::StatusOr<bool> BoolOr(absl::string_view key, bool fallback) const {
    const json* value = Get(key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean())
      return Error(key, absl::StrCat("must be true or false, got ", Quote(*value)));
    return value->get<bool>();
  }

 private:
  const json& object_;
  absl::string_view source_;
  absl::string_view prefix_;
};

}  // namespace

DcaGeometry ModelConfig::geometry() const {
  DcaGeometry g;
  g.num_q_heads = num_q_heads;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  g.chunk_len = chunk_len();
  g.original_max_position_embeddings = original_max_position_embeddings;
  g.softmax_scale = softmax_scale;
  g.chunk_size = chunk_size;
  g.rope_theta = rope_theta;
  g.rotary_dim = rotary_dim;
  return g;
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view text,
                                             absl::string_view source_name) {
  const json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    ParseErrorLocator locator;
    json::sax_parse(text.begin(), text.end(), &locator);
    return absl::InvalidArgumentError(
        absl::StrCat(source_name, ": not valid JSON (",
                     locator.error().empty() ? "no detail" : locator.error(), ")"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source_name, ": expected a JSON object at the top level, got ", Quote(root)));
  }
  const ObjectReader top(root, source_name, "");
  ModelConfig config;

  if (const json* name = top.Get("_name_or_path"); name != nullptr) {
    if (!name->is_string()) {
      return top.Error("_name_or_path", absl::StrCat("must be a string, got ", Quote(*name)));
    }
    config.name = name->get<std::string>();
  }
  if (config.name.empty()) config.name = NameFromSource(source_name);

  ATTND_ASSIGN_OR_RETURN(const int64_t num_layers,
                         top.RequiredInt("num_hidden_layers", 1, kInt32Max));
  ATTND_ASSIGN_OR_RETURN(const int64_t num_q_heads,
                         top.RequiredInt("num_attention_heads", 1, kInt32Max));
  // Hugging Face: no num_key_value_heads means multi-head attention (one kv head per q head).
  ATTND_ASSIGN_OR_RETURN(const int64_t num_kv_heads,
                         top.IntOr("num_key_value_heads", 1, kInt32Max, num_q_heads));
  if (num_q_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source_name, ": num_attention_heads (", num_q_heads,
                     ") must be a multiple of num_key_value_heads (", num_kv_heads, ")"));
  }
  ATTND_ASSIGN_OR_RETURN(std::optional<int64_t> head_dim,
                         top.Int("head_dim", 1, kInt32Max, /*required=*/false));
  if (!head_dim.has_value()) {
    if (top.Get("hidden_size") == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_name,
                       ": head_dim and hidden_size are both missing; expected a positive integer "
                       "in one of them"));
    }
    ATTND_ASSIGN_OR_RETURN(const int64_t hidden_size, top.RequiredInt("hidden_size", 1, kInt64Max));
    if (hidden_size % num_q_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_name, ": hidden_size (", hidden_size,
                       ") must be a multiple of num_attention_heads (", num_q_heads,
                       ") when head_dim is absent"));
    }
    head_dim = hidden_size / num_q_heads;
    if (*head_dim > kInt32Max) {
      return top.Error("hidden_size", absl::StrCat("/ num_attention_heads must be at most ",
                                                   kInt32Max, ", got ", *head_dim));
    }
  }
  ATTND_ASSIGN_OR_RETURN(const int64_t max_positions,
                         top.RequiredInt("max_position_embeddings", 1, kInt64Max));

  config.num_layers = static_cast<int32_t>(num_layers);
  config.num_q_heads = static_cast<int32_t>(num_q_heads);
  config.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  config.head_dim = static_cast<int32_t>(*head_dim);
  config.max_position_embeddings = max_positions;
  config.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(*head_dim)));

  // The rotary embedding attnd applies to pre-rotary requests (Hugging Face's rule: the rotated
  // dims are int(head_dim * partial_rotary_factor)).
  ATTND_ASSIGN_OR_RETURN(config.rope_theta,
                         top.NumberOr("rope_theta", 1.0, std::numeric_limits<double>::max(),
                                      "a number greater than 1", kDefaultRopeTheta));
  ATTND_ASSIGN_OR_RETURN(const double partial, top.NumberOr("partial_rotary_factor", 0.0, 1.0,
                                                            "a number in (0, 1]", 1.0));
  config.partial_rotary_factor = static_cast<float>(partial);
  const int64_t rotary_dim = static_cast<int64_t>(static_cast<double>(*head_dim) * partial);
  if (rotary_dim < 2 || rotary_dim % 2 != 0) {
    return top.Error("partial_rotary_factor",
                     absl::StrCat("(", partial, ") times head_dim (", *head_dim,
                                  ") must give an even rotary dimension >= 2, got ", rotary_dim));
  }
  config.rotary_dim = static_cast<int32_t>(rotary_dim);

  static const json kEmptyObject = json::object();
  const json* dca = top.Get("dual_chunk_attention_config");
  if (dca != nullptr && !dca->is_object()) {
    return top.Error("dual_chunk_attention_config",
                     absl::StrCat("must be an object, got ", Quote(*dca)));
  }
  const ObjectReader dca_reader(dca != nullptr ? *dca : kEmptyObject, source_name,
                                "dual_chunk_attention_config.");
  ATTND_ASSIGN_OR_RETURN(config.chunk_size,
                         dca_reader.IntOr("chunk_size", 1, kInt64Max, kDefaultChunkSize));
  ATTND_ASSIGN_OR_RETURN(config.local_size,
                         dca_reader.IntOr("local_size", 1, kInt64Max, kDefaultLocalSize));
  if (config.local_size >= config.chunk_size) {
    return dca_reader.Error("local_size",
                            absl::StrCat("(", config.local_size, ") must be less than chunk_size (",
                                         config.chunk_size, ")"));
  }
  ATTND_ASSIGN_OR_RETURN(config.original_max_position_embeddings,
                         dca_reader.IntOr("original_max_position_embeddings", 0, kInt64Max,
                                          kDefaultOriginalMaxPositionEmbeddings));
  ATTND_ASSIGN_OR_RETURN(config.sparse_attention_enabled,
                         dca_reader.BoolOr("sparse_attention_enabled", false));
  config.sparse_attention_enabled_set = dca_reader.Get("sparse_attention_enabled") != nullptr;
  ATTND_ASSIGN_OR_RETURN(config.sparse_attention_threshold,
                         dca_reader.IntOr("sparse_attention_threshold", 0, kInt64Max,
                                          kDefaultSparseAttentionThreshold));
  ATTND_ASSIGN_OR_RETURN(
      config.sparse_attention_last_q,
      dca_reader.IntOr("sparse_attention_last_q", 1, kInt32Max, kDefaultSparseAttentionLastQ));
  if (dca == nullptr) {
    config.warnings.push_back(absl::StrCat(
        source_name, ": no dual_chunk_attention_config; serving DCA with the defaults chunk_size ",
        config.chunk_size, ", local_size ", config.local_size, " (chunk_len ", config.chunk_len(),
        "), original_max_position_embeddings ", config.original_max_position_embeddings,
        " (no length scaling), sparse attention off. A model not trained for these gets attention "
        "that differs from its own beyond ",
        config.chunk_len(), " tokens: add its dual_chunk_attention_config to config.json"));
  }
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  std::string file = path;
  struct stat st;
  if (stat(file.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    // A model directory, as downloaded from the Hub: its config.json is the config.
    file = absl::StrCat(path, absl::EndsWith(path, "/") ? "" : "/", "config.json");
  }
  if (stat(file.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat("model config not found: ", file));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": cannot read model config: ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": cannot read model config: not a regular file"));
  }
  if (st.st_size > kMaxConfigBytes) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", st.st_size,
                                                   " bytes is too large for a config.json (limit ",
                                                   kMaxConfigBytes, ")"));
  }
  const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": cannot read model config: ", std::strerror(errno)));
  }
  std::string text;
  char buf[1 << 14];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
      text.append(buf, static_cast<size_t>(n));
      if (static_cast<int64_t>(text.size()) > kMaxConfigBytes) break;  // grew since the stat
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": cannot read model config: ", std::strerror(err)));
    }
    break;
  }
  close(fd);
  if (static_cast<int64_t>(text.size()) > kMaxConfigBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": too large for a config.json (limit ", kMaxConfigBytes, " bytes)"));
  }
  ATTND_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, file));
  // The sparse pattern file sits beside config.json (Hugging Face model folders; SGLang/vLLM read
  // it the same way).
  const size_t slash = file.rfind('/');
  SparseSettings settings;
  if (config.sparse_attention_enabled_set) settings.enabled = config.sparse_attention_enabled;
  settings.threshold = config.sparse_attention_threshold;
  settings.last_q = config.sparse_attention_last_q;
  ATTND_ASSIGN_OR_RETURN(
      std::optional<SparseAttentionConfig> sparse,
      LoadSparseAttentionConfig(slash == std::string::npos ? "." : file.substr(0, slash),
                                config.num_layers, config.num_q_heads, settings));
  if (sparse.has_value()) {
    config.sparse_attention_enabled = sparse->enabled;
    config.sparse = std::make_shared<const SparseAttentionConfig>(*std::move(sparse));
  }
  for (const std::string& warning : config.warnings) spdlog::warn("{}", warning);
  return config;
}

ModelConfig Qwen25_7BInstruct1M() {
  ModelConfig c;
  c.name = "Qwen/Qwen2.5-7B-Instruct-1M";
  c.num_layers = 28;
  c.num_q_heads = 28;
  c.num_kv_heads = 4;
  c.head_dim = 128;  // hidden_size 3584 / 28
  c.max_position_embeddings = 1010000;
  c.chunk_size = 262144;
  c.local_size = 8192;
  c.original_max_position_embeddings = 262144;
  c.sparse_attention_enabled = false;  // the pattern file is not embedded
  c.sparse_attention_threshold = kDefaultSparseAttentionThreshold;
  c.sparse_attention_last_q = kDefaultSparseAttentionLastQ;
  c.softmax_scale = static_cast<float>(1.0 / std::sqrt(128.0));
  c.rope_theta = 10000000.0;  // config.json: 1e7, no partial_rotary_factor
  c.partial_rotary_factor = 1.f;
  c.rotary_dim = 128;
  return c;
}

}  // namespace attnd
