#include "server/config/model_config.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"

namespace attnd {
namespace {

using ::testing::StartsWith;

// A valid config with every key the loader reads, each a distinct value, so that a field read
// from the wrong key shows up.
constexpr char kFull[] = R"({
  "_name_or_path": "acme/full",
  "num_hidden_layers": 3,
  "num_attention_heads": 12,
  "num_key_value_heads": 4,
  "head_dim": 32,
  "hidden_size": 999,
  "max_position_embeddings": 5000,
  "dual_chunk_attention_config": {
    "chunk_size": 300,
    "local_size": 44,
    "original_max_position_embeddings": 200,
    "sparse_attention_enabled": true,
    "sparse_attention_threshold": 1000,
    "sparse_attention_last_q": 16
  }
})";

// The minimal valid config: required keys only.
constexpr char kMinimal[] = R"({
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "hidden_size": 256,
  "max_position_embeddings": 4096,
  "dual_chunk_attention_config": {"chunk_size": 160, "local_size": 32}
})";

void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_q_heads, b.num_q_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.chunk_size, b.chunk_size);
  EXPECT_EQ(a.local_size, b.local_size);
  EXPECT_EQ(a.original_max_position_embeddings, b.original_max_position_embeddings);
  EXPECT_EQ(a.sparse_attention_enabled, b.sparse_attention_enabled);
  EXPECT_EQ(a.sparse_attention_threshold, b.sparse_attention_threshold);
  EXPECT_EQ(a.sparse_attention_last_q, b.sparse_attention_last_q);
  EXPECT_EQ(a.softmax_scale, b.softmax_scale);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.partial_rotary_factor, b.partial_rotary_factor);
  EXPECT_EQ(a.rotary_dim, b.rotary_dim);
}

// ---- Shipped configs: values from docs/DCA.md "Model constants" ----

TEST(ModelConfigTest, ShippedQwen7B) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("configs/qwen2.5-7b-instruct-1m/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "Qwen/Qwen2.5-7B-Instruct-1M");
  EXPECT_EQ(c->num_layers, 28);
  EXPECT_EQ(c->num_q_heads, 28);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 128);  // 3584 / 28
  EXPECT_EQ(c->max_position_embeddings, 1010000);
  EXPECT_EQ(c->chunk_size, 262144);
  EXPECT_EQ(c->local_size, 8192);
  EXPECT_EQ(c->chunk_len(), 253952);
  EXPECT_EQ(c->original_max_position_embeddings, 262144);
  // The folder ships sparse_attention_config.json, which turns sparse prefill on.
  EXPECT_TRUE(c->sparse_attention_enabled);
  ASSERT_NE(c->sparse, nullptr);
  EXPECT_EQ(c->sparse->budgets.size(), 28u * 28u);
  EXPECT_EQ(c->sparse_attention_threshold, 32768);
  EXPECT_EQ(c->sparse_attention_last_q, 64);
  EXPECT_FLOAT_EQ(c->softmax_scale, 0.08838834764831845f);
  EXPECT_EQ(c->rope_theta, 1e7);
  EXPECT_EQ(c->partial_rotary_factor, 1.f);
  EXPECT_EQ(c->rotary_dim, 128);

  const DcaGeometry g = c->geometry();
  EXPECT_EQ(g.num_q_heads, 28);
  EXPECT_EQ(g.num_kv_heads, 4);
  EXPECT_EQ(g.group_size(), 7);
  EXPECT_EQ(g.head_dim, 128);
  EXPECT_EQ(g.chunk_len, 253952);
  EXPECT_EQ(g.original_max_position_embeddings, 262144);
  EXPECT_FLOAT_EQ(g.softmax_scale, 0.08838834764831845f);
  EXPECT_EQ(g.chunk_size, 262144);
  EXPECT_EQ(g.rope_theta, 1e7);
  EXPECT_EQ(g.rotary_dim, 128);

  // The embedded default is the same model, without the pattern file.
  ModelConfig dense = *c;
  dense.sparse_attention_enabled = false;
  ExpectSameConfig(Qwen25_7BInstruct1M(), dense);
  EXPECT_EQ(Qwen25_7BInstruct1M().sparse, nullptr);
}

TEST(ModelConfigTest, ShippedQwen14B) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("configs/qwen2.5-14b-instruct-1m/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "Qwen/Qwen2.5-14B-Instruct-1M");
  EXPECT_EQ(c->num_layers, 48);
  EXPECT_EQ(c->num_q_heads, 40);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);  // 5120 / 40
  EXPECT_EQ(c->geometry().group_size(), 5);
  EXPECT_EQ(c->max_position_embeddings, 1010000);
  EXPECT_EQ(c->chunk_size, 262144);
  EXPECT_EQ(c->local_size, 8192);
  EXPECT_EQ(c->chunk_len(), 253952);
  EXPECT_EQ(c->original_max_position_embeddings, 262144);
  EXPECT_FALSE(c->sparse_attention_enabled);
  EXPECT_FLOAT_EQ(c->softmax_scale, 0.08838834764831845f);
}

TEST(ModelConfigTest, ShippedTinyMatchesTheGoldenCase) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("configs/tiny/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "tiny");  // no _name_or_path: named by its directory
  EXPECT_EQ(c->num_layers, 2);
  EXPECT_EQ(c->num_q_heads, 4);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->max_position_embeddings, 4096);
  EXPECT_EQ(c->chunk_size, 160);
  EXPECT_EQ(c->local_size, 32);
  EXPECT_EQ(c->chunk_len(), 128);
  EXPECT_EQ(c->original_max_position_embeddings, 256);
  EXPECT_FALSE(c->sparse_attention_enabled);
  EXPECT_EQ(c->sparse_attention_threshold, 32768);
  EXPECT_EQ(c->sparse_attention_last_q, 64);
  EXPECT_EQ(c->softmax_scale, 0.125f);  // the golden case's softmax_scale, exactly
  EXPECT_EQ(c->geometry().chunk_len, 128);
  EXPECT_EQ(c->rope_theta, 10000.0);  // dense_pre_rotary's rope_theta and rotary_dim
  EXPECT_EQ(c->rotary_dim, 64);
}

TEST(ModelConfigTest, LoadsAModelDirectory) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("configs/tiny");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "tiny");
  EXPECT_EQ(c->chunk_len(), 128);
  c = LoadModelConfig("configs/qwen2.5-14b-instruct-1m/");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_layers, 48);
}

// ---- Parsing ----

TEST(ModelConfigTest, ReadsEveryKey) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kFull, "full.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "acme/full");
  EXPECT_EQ(c->num_layers, 3);
  EXPECT_EQ(c->num_q_heads, 12);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 32);  // head_dim wins over hidden_size / num_attention_heads
  EXPECT_EQ(c->max_position_embeddings, 5000);
  EXPECT_EQ(c->chunk_size, 300);
  EXPECT_EQ(c->local_size, 44);
  EXPECT_EQ(c->chunk_len(), 256);
  EXPECT_EQ(c->original_max_position_embeddings, 200);
  EXPECT_TRUE(c->sparse_attention_enabled);
  EXPECT_EQ(c->sparse_attention_threshold, 1000);
  EXPECT_EQ(c->sparse_attention_last_q, 16);
  EXPECT_FLOAT_EQ(c->softmax_scale, static_cast<float>(1.0 / std::sqrt(32.0)));
}

TEST(ModelConfigTest, DefaultsWhenKeysAreAbsent) {
  // No num_key_value_heads (HF: multi-head), no head_dim, no dual_chunk_attention_config.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
      "num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 512,
      "max_position_embeddings": 100, "head_dim": null})",
                                                   "models/plain.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "plain");  // the file's stem
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->chunk_size, 8192);
  EXPECT_EQ(c->local_size, 1024);
  EXPECT_EQ(c->chunk_len(), 7168);
  EXPECT_EQ(c->original_max_position_embeddings, 0);
  EXPECT_FALSE(c->sparse_attention_enabled);
  EXPECT_EQ(c->sparse_attention_threshold, 32768);
  EXPECT_EQ(c->sparse_attention_last_q, 64);
  EXPECT_EQ(c->geometry().original_max_position_embeddings, 0);
  EXPECT_EQ(c->rope_theta, 10000.0);  // Hugging Face's Qwen2 default
  EXPECT_EQ(c->partial_rotary_factor, 1.f);
  EXPECT_EQ(c->rotary_dim, 64);

  // No dual_chunk_attention_config at all: a warning names the file and every default used.
  ASSERT_EQ(c->warnings.size(), 1u);
  const std::string& w = c->warnings[0];
  EXPECT_NE(w.find("models/plain.json: no dual_chunk_attention_config"), std::string::npos) << w;
  EXPECT_NE(w.find(absl::StrCat("chunk_size ", kDefaultChunkSize)), std::string::npos) << w;
  EXPECT_NE(w.find(absl::StrCat("local_size ", kDefaultLocalSize)), std::string::npos) << w;
  EXPECT_NE(w.find(absl::StrCat("chunk_len ", kDefaultChunkSize - kDefaultLocalSize)),
            std::string::npos)
      << w;
  EXPECT_NE(w.find("original_max_position_embeddings 0"), std::string::npos) << w;

  // An empty dual_chunk_attention_config gets the same defaults.
  c = ParseModelConfig(kMinimal, "/models/m/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->warnings.empty());  // the key is there
  EXPECT_EQ(c->name, "m");
  EXPECT_EQ(c->chunk_size, 160);
  EXPECT_EQ(c->original_max_position_embeddings, 0);
  EXPECT_EQ(c->sparse_attention_threshold, 32768);
}

// ---- Malformed configs: INVALID_ARGUMENT naming the file, the key and what was expected ----

std::string Minimal(absl::string_view replace_line_with) {
  return absl::StrCat(R"({"num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "hidden_size": 256, "max_position_embeddings": 4096, )",
                      replace_line_with, "}");
}

TEST(ModelConfigTest, MalformedKeysNameFileKeyAndExpectation) {
  const std::string base_head = R"("num_key_value_heads": 2, "hidden_size": 256,
      "max_position_embeddings": 4096)";
  struct Case {
    std::string json;
    std::string message;
  } cases[] = {
      // Required integers: wrong type, sign, fraction, missing, too large.
      {R"({"num_hidden_layers": 2, "num_attention_heads": "abc", )" + base_head + "}",
       R"(num_attention_heads must be a positive integer, got "abc")"},
      {R"({"num_hidden_layers": 0, "num_attention_heads": 4, )" + base_head + "}",
       "num_hidden_layers must be a positive integer, got 0"},
      {R"({"num_hidden_layers": -3, "num_attention_heads": 4, )" + base_head + "}",
       "num_hidden_layers must be a positive integer, got -3"},
      {R"({"num_hidden_layers": 2.5, "num_attention_heads": 4, )" + base_head + "}",
       "num_hidden_layers must be a positive integer, got 2.5"},
      {R"({"num_hidden_layers": true, "num_attention_heads": 4, )" + base_head + "}",
       "num_hidden_layers must be a positive integer, got true"},
      {R"({"num_hidden_layers": [2], "num_attention_heads": 4, )" + base_head + "}",
       "num_hidden_layers must be a positive integer, got [2]"},
      {R"({"num_attention_heads": 4, )" + base_head + "}",
       "num_hidden_layers is missing; expected a positive integer"},
      {R"({"num_hidden_layers": null, "num_attention_heads": 4, )" + base_head + "}",
       "num_hidden_layers is missing; expected a positive integer"},
      {R"({"num_hidden_layers": 2, )" + base_head + "}",
       "num_attention_heads is missing; expected a positive integer"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 3000000000, )" + base_head + "}",
       "num_attention_heads must be at most 2147483647, got 3000000000"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})",
       "max_position_embeddings is missing; expected a positive integer"},
      {Minimal(R"("max_position_embeddings": 0)"),
       "max_position_embeddings must be a positive integer, got 0"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
           "max_position_embeddings": 18446744073709551615})",
       "max_position_embeddings must be at most 9223372036854775807, got 18446744073709551615"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
           "max_position_embeddings": 1e10})",
       "max_position_embeddings must be a positive integer, got 10000000000.0"},
      // Heads.
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
           "hidden_size": 256, "max_position_embeddings": 4096})",
       "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": "2",
           "hidden_size": 256, "max_position_embeddings": 4096})",
       R"(num_key_value_heads must be a positive integer, got "2")"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 0,
           "hidden_size": 256, "max_position_embeddings": 4096})",
       "num_key_value_heads must be a positive integer, got 0"},
      // Head dim.
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 0,
           "max_position_embeddings": 4096})",
       "head_dim must be a positive integer, got 0"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 250,
           "max_position_embeddings": 4096})",
       "hidden_size (250) must be a multiple of num_attention_heads (4) when head_dim is absent"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": "big",
           "max_position_embeddings": 4096})",
       R"(hidden_size must be a positive integer, got "big")"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096})",
       "head_dim and hidden_size are both missing; expected a positive integer in one of them"},
      // dual_chunk_attention_config.
      {Minimal(R"("dual_chunk_attention_config": 5)"),
       "dual_chunk_attention_config must be an object, got 5"},
      {Minimal(R"("dual_chunk_attention_config": [160, 32])"),
       "dual_chunk_attention_config must be an object, got [160,32]"},
      {Minimal(R"("dual_chunk_attention_config": {"chunk_size": "x"})"),
       R"(dual_chunk_attention_config.chunk_size must be a positive integer, got "x")"},
      {Minimal(R"("dual_chunk_attention_config": {"chunk_size": 160, "local_size": 0})"),
       "dual_chunk_attention_config.local_size must be a positive integer, got 0"},
      {Minimal(R"("dual_chunk_attention_config": {"chunk_size": 160, "local_size": 160})"),
       "dual_chunk_attention_config.local_size (160) must be less than chunk_size (160)"},
      {Minimal(R"("dual_chunk_attention_config": {"chunk_size": 160, "local_size": 200})"),
       "dual_chunk_attention_config.local_size (200) must be less than chunk_size (160)"},
      // Defaults count too: chunk_size 512 with the default local_size 1024 is impossible.
      {Minimal(R"("dual_chunk_attention_config": {"chunk_size": 512})"),
       "dual_chunk_attention_config.local_size (1024) must be less than chunk_size (512)"},
      {Minimal(R"("dual_chunk_attention_config": {"original_max_position_embeddings": -1})"),
       "dual_chunk_attention_config.original_max_position_embeddings must be a non-negative "
       "integer, got -1"},
      {Minimal(R"("dual_chunk_attention_config": {"sparse_attention_enabled": "yes"})"),
       R"(dual_chunk_attention_config.sparse_attention_enabled must be true or false, got "yes")"},
      {Minimal(R"("dual_chunk_attention_config": {"sparse_attention_enabled": 1})"),
       "dual_chunk_attention_config.sparse_attention_enabled must be true or false, got 1"},
      {Minimal(R"("dual_chunk_attention_config": {"sparse_attention_threshold": -5})"),
       "dual_chunk_attention_config.sparse_attention_threshold must be a non-negative integer, "
       "got -5"},
      {Minimal(R"("dual_chunk_attention_config": {"sparse_attention_last_q": 0})"),
       "dual_chunk_attention_config.sparse_attention_last_q must be a positive integer, got 0"},
      // Rotary.
      {Minimal(R"("rope_theta": "1e7")"),
       R"(rope_theta must be a number greater than 1, got "1e7")"},
      {Minimal(R"("rope_theta": 0.5)"), "rope_theta must be a number greater than 1, got 0.5"},
      {Minimal(R"("partial_rotary_factor": 0)"),
       "partial_rotary_factor must be a number in (0, 1], got 0"},
      {Minimal(R"("partial_rotary_factor": 1.5)"),
       "partial_rotary_factor must be a number in (0, 1], got 1.5"},
      {Minimal(R"("partial_rotary_factor": 0.02)"),
       "partial_rotary_factor (0.02) times head_dim (64) must give an even rotary dimension >= 2, "
       "got 1"},
      // Metadata.
      {Minimal(R"("_name_or_path": 7)"), "_name_or_path must be a string, got 7"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelConfig> config = ParseModelConfig(c.json, "configs/x.json");
    ASSERT_FALSE(config.ok()) << c.json;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_EQ(config.status().message(), "configs/x.json: " + c.message) << c.json;
  }
}

TEST(ModelConfigTest, ReadsTheRotary) {
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(Minimal(R"("rope_theta": 1000000, "partial_rotary_factor": 0.5)"), "p.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 1e6);  // an integer is a number too
  EXPECT_EQ(c->partial_rotary_factor, 0.5f);
  EXPECT_EQ(c->rotary_dim, 32);  // head_dim 64 (hidden_size 256 / 4 heads) * 0.5
  EXPECT_EQ(c->geometry().rotary_dim, 32);
  EXPECT_EQ(c->geometry().rope_theta, 1e6);
  EXPECT_EQ(c->geometry().chunk_size, 8192);
}

TEST(ModelConfigTest, LongValuesAreQuotedShort) {
  const std::string long_value(500, 'z');
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      Minimal(absl::StrCat(R"("_name_or_path": "n", "head_dim": ")", long_value, R"(")")),
      "configs/x.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            absl::StrCat("configs/x.json: head_dim must be a positive integer, got \"",
                         std::string(79, 'z'), "..."));
}

TEST(ModelConfigTest, NotJson) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig("{\n  \"num_hidden_layers\": 2,\n}", "bad.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            "bad.json: not valid JSON (parse error at line 3, column 1: syntax error while parsing "
            "object key - unexpected '}'; expected string literal)");

  c = ParseModelConfig("", "empty.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              StartsWith("empty.json: not valid JSON (parse error at line 1"));

  c = ParseModelConfig("{} trailing", "trail.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), StartsWith("trail.json: not valid JSON ("));

  c = ParseModelConfig("[1, 2]", "array.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), "array.json: expected a JSON object at the top level, got [1,2]");
}

// ---- Files ----

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

TEST(ModelConfigTest, MissingFileIsNotFound) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("configs/nope/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(), "model config not found: configs/nope/config.json");

  // A directory without a config.json names the file it looked for.
  const std::string dir = TempDir() + "/empty_model";
  mkdir(dir.c_str(), 0755);
  c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(), "model config not found: " + dir + "/config.json");
}

TEST(ModelConfigTest, UnreadableFileIsInvalidArgument) {
  // A directory where config.json should be: exists, but is not a file to read (root ignores
  // permission bits, so chmod 000 would not make the test fail reliably).
  const std::string dir = TempDir() + "/weird_model";
  mkdir(dir.c_str(), 0755);
  mkdir((dir + "/config.json").c_str(), 0755);
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            dir + "/config.json: cannot read model config: not a regular file");
}

TEST(ModelConfigTest, InvalidFileNamesThePath) {
  const std::string path = TempDir() + "/broken.json";
  {
    std::ofstream out(path);
    out << R"({"num_hidden_layers": 2, "num_attention_heads": "abc"})";
  }
  absl::StatusOr<ModelConfig> c = LoadModelConfig(path);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            path + R"(: num_attention_heads must be a positive integer, got "abc")");

  {
    std::ofstream out(path);
    out << "not json";
  }
  c = LoadModelConfig(path);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              StartsWith(path + ": not valid JSON (parse error at line 1"));
}

// ---- sparse_attention_config.json beside config.json (server/config/sparse_config.h) ----

TEST(ModelConfigTest, ShippedTinySparse) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("configs/tiny-sparse");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->sparse_attention_enabled);
  ASSERT_NE(c->sparse, nullptr);
  EXPECT_TRUE(c->sparse->enabled);
  EXPECT_EQ(c->sparse->threshold, 256);
  EXPECT_EQ(c->sparse->last_q, 64);
  EXPECT_EQ(c->sparse->source, "configs/tiny-sparse/sparse_attention_config.json");
  EXPECT_EQ(c->sparse->layer(0)[0].vertical, 130);  // 30 read as 130
  EXPECT_FALSE(c->sparse->UseSparse(256));
  EXPECT_TRUE(c->sparse->UseSparse(257));
}

std::string SparseModelDir(const std::string& name, const char* enabled_key) {
  const std::string dir = TempDir() + "/" + name;
  mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/config.json") << R"({
  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
  "max_position_embeddings": 4096,
  "dual_chunk_attention_config": {"chunk_size": 160, "local_size": 32)"
                                      << enabled_key << "}}";
  return dir;
}

TEST(ModelConfigTest, SparsePatternFileRules) {
  const std::string pattern =
      R"([{"0": ["vertical_and_slash", 30, 100, 0.9], "1": ["vertical_and_slash", 64, 200, 0.9]}])";
  // The file alone turns sparse on.
  std::string dir = SparseModelDir("sparse_on", "");
  std::ofstream(dir + "/sparse_attention_config.json") << pattern;
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir + "/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->sparse_attention_enabled);
  ASSERT_NE(c->sparse, nullptr);
  EXPECT_EQ(c->sparse->layer(0)[1].slash, 200);

  // config.json can turn it off; the budgets are still read and checked.
  dir = SparseModelDir("sparse_off", R"(, "sparse_attention_enabled": false)");
  std::ofstream(dir + "/sparse_attention_config.json") << pattern;
  c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->sparse_attention_enabled);
  ASSERT_NE(c->sparse, nullptr);
  EXPECT_FALSE(c->sparse->enabled);

  // Enabled without the file: a load error, not a silent dense fallback.
  dir = SparseModelDir("sparse_no_file", R"(, "sparse_attention_enabled": true)");
  c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            "dual_chunk_attention_config.sparse_attention_enabled is true but " + dir +
                "/sparse_attention_config.json does not exist; sparse prefill needs its per-head "
                "budgets");

  // A file that does not fit the model names the file and the entry.
  dir = SparseModelDir("sparse_bad_file", "");
  std::ofstream(dir + "/sparse_attention_config.json")
      << R"([{"0": ["vertical_and_slash", 30, 100, 0.9], "1": ["a_shape", 64, 200, 0.9]}])";
  c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            dir + R"(/sparse_attention_config.json: layer 0 head "1": unknown pattern type )"
                  R"("a_shape" (only "vertical_and_slash" is supported))");
  dir = SparseModelDir("sparse_wrong_layers", "");
  std::ofstream(dir + "/sparse_attention_config.json")
      << "[" << pattern.substr(1, pattern.size() - 2) << ", {}]";
  c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            dir + "/sparse_attention_config.json: has 2 layers, the model has 1");
}

}  // namespace
}  // namespace attnd
