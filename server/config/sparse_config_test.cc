// sparse_attention_config.json: budgets per layer and head (30 read as 130), every malformed
// input rejected at load with INVALID_ARGUMENT naming the file and the entry, the enable rules,
// the strict threshold, and the shipped pattern files.
#include "server/config/sparse_config.h"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

using ::testing::HasSubstr;

std::string Entry(int64_t v, int64_t s) {
  return absl::StrCat("[\"vertical_and_slash\", ", v, ", ", s, ", 0.9]");
}

TEST(ParseSparsePatternTest, ReadsBudgetsByHeadIndexAndReads30As130) {
  // Keys in any order; "10" sorts before "2" as a string but is head 10.
  std::string layer0 = "{";
  for (int h = 11; h >= 0; --h) {
    absl::StrAppend(&layer0, "\"", h, "\": ", Entry(h == 3 ? 30 : 100 + h, 1000 + h),
                    h > 0 ? ", " : "}");
  }
  std::string layer1 = "{";
  for (int h = 0; h < 12; ++h) {
    absl::StrAppend(&layer1, "\"", h, "\": ", Entry(31, 6096), h < 11 ? ", " : "}");
  }
  const std::string text = absl::StrCat("[", layer0, ", ", layer1, "]");
  absl::StatusOr<std::vector<VsBudget>> b = ParseSparsePattern(text, "f.json", 2, 12);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->size(), 24u);
  for (int h = 0; h < 12; ++h) {
    EXPECT_EQ((*b)[h].vertical, h == 3 ? 130 : 100 + h) << h;
    EXPECT_EQ((*b)[h].slash, 1000 + h) << h;
    EXPECT_EQ((*b)[12 + h].vertical, 31);
    EXPECT_EQ((*b)[12 + h].slash, 6096);
  }
}

std::string OneLayer(const std::vector<std::pair<std::string, std::string>>& heads) {
  std::string s = "[{";
  for (size_t i = 0; i < heads.size(); ++i) {
    absl::StrAppend(&s, i ? ", " : "", "\"", heads[i].first, "\": ", heads[i].second);
  }
  return s + "}]";
}

TEST(ParseSparsePatternTest, RejectsMalformedFilesNamingTheEntry) {
  const std::string ok = Entry(1000, 6096);
  struct Case {
    std::string text;
    int32_t layers;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"[{", 1, "p.json: not valid JSON"},
      {"", 1, "p.json: not valid JSON"},
      {R"({"0": {}})", 1, "p.json: expected a list of per-layer objects, got {\"0\":{}}"},
      {OneLayer({{"0", ok}, {"1", ok}}), 2, "p.json: has 1 layers, the model has 2"},
      {"[[1, 2]]", 1, "p.json: layer 0: expected an object of heads, got [1,2]"},
      {OneLayer({{"0", ok}}), 1, "p.json: layer 0 has 1 heads, the model has 2 q heads"},
      {OneLayer({{"0", ok}, {"2", ok}}), 1,
       "p.json: layer 0 head \"2\": not a q head index in [0, 2)"},
      {OneLayer({{"0", ok}, {"x", ok}}), 1,
       "p.json: layer 0 head \"x\": not a q head index in [0, 2)"},
      {OneLayer({{"0", ok}, {"-1", ok}}), 1,
       "p.json: layer 0 head \"-1\": not a q head index in [0, 2)"},
      {OneLayer({{"0", ok}, {"1", "[\"vertical_and_slash\", 1, 2]"}}), 1,
       "p.json: layer 0 head \"1\": expected [\"vertical_and_slash\", vertical_size, slash_size, "
       "score], got [\"vertical_and_slash\",1,2]"},
      {OneLayer({{"0", ok}, {"1", "[\"a_shape\", 128, 1024, 0.9]"}}), 1,
       "p.json: layer 0 head \"1\": unknown pattern type \"a_shape\" (only \"vertical_and_slash\" "
       "is supported)"},
      {OneLayer({{"0", "[7, 128, 1024, 0.9]"}, {"1", ok}}), 1,
       "p.json: layer 0 head \"0\": pattern type must be a string, got 7"},
      {OneLayer({{"0", ok}, {"1", "[\"vertical_and_slash\", 0, 1024, 0.9]"}}), 1,
       "p.json: layer 0 head \"1\": vertical_size must be a positive integer, got 0"},
      {OneLayer({{"0", ok}, {"1", "[\"vertical_and_slash\", 100.5, 1024, 0.9]"}}), 1,
       "p.json: layer 0 head \"1\": vertical_size must be a positive integer, got 100.5"},
      {OneLayer({{"0", ok}, {"1", "[\"vertical_and_slash\", 100, \"1024\", 0.9]"}}), 1,
       "p.json: layer 0 head \"1\": slash_size must be a positive integer, got \"1024\""},
      {OneLayer({{"0", ok}, {"1", "[\"vertical_and_slash\", 100, -3, 0.9]"}}), 1,
       "p.json: layer 0 head \"1\": slash_size must be a positive integer, got -3"},
      {OneLayer({{"0", ok}, {"1", "[\"vertical_and_slash\", 100, 200, null]"}}), 1,
       "p.json: layer 0 head \"1\": score must be a number, got null"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<VsBudget>> b = ParseSparsePattern(c.text, "p.json", c.layers, 2);
    ASSERT_FALSE(b.ok()) << c.text;
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_EQ(b.status().message(), c.message) << c.text;
  }
}

// A fresh directory under $TEST_TMPDIR.
std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
  mkdir(dir.c_str(), 0755);
  return dir;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

TEST(LoadSparseAttentionConfigTest, EnableRules) {
  const std::string dir = TempDir("with_pattern");
  WriteFile(dir + "/sparse_attention_config.json",
            OneLayer({{"0", Entry(30, 100)}, {"1", Entry(64, 200)}}));
  SparseSettings settings;
  settings.threshold = 256;
  settings.last_q = 16;

  // The file alone turns sparse on.
  absl::StatusOr<std::optional<SparseAttentionConfig>> c =
      LoadSparseAttentionConfig(dir, 1, 2, settings);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_value());
  const SparseAttentionConfig& s = **c;
  EXPECT_EQ(s.source, dir + "/sparse_attention_config.json");
  EXPECT_TRUE(s.enabled);
  EXPECT_EQ(s.threshold, 256);
  EXPECT_EQ(s.last_q, 16);
  ASSERT_EQ(s.layer(0).size(), 2u);
  EXPECT_EQ(s.layer(0)[0].vertical, 130);
  EXPECT_EQ(s.layer(0)[0].slash, 100);
  EXPECT_EQ(s.layer(0)[1].vertical, 64);
  // Strictly greater than the threshold.
  EXPECT_FALSE(s.UseSparse(256));
  EXPECT_TRUE(s.UseSparse(257));

  // config.json can switch it off; the budgets still load (and are still checked).
  settings.enabled = false;
  c = LoadSparseAttentionConfig(dir + "/", 1, 2, settings);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_value());
  EXPECT_FALSE((*c)->enabled);
  EXPECT_FALSE((*c)->UseSparse(100000));

  // A model geometry the file does not fit.
  settings.enabled.reset();
  c = LoadSparseAttentionConfig(dir, 2, 2, settings);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            absl::StrCat(dir, "/sparse_attention_config.json: has 1 layers, the model has 2"));
}

TEST(LoadSparseAttentionConfigTest, NoFile) {
  const std::string dir = TempDir("without_pattern");
  SparseSettings settings;
  absl::StatusOr<std::optional<SparseAttentionConfig>> c =
      LoadSparseAttentionConfig(dir, 1, 2, settings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->has_value());
  settings.enabled = false;
  c = LoadSparseAttentionConfig(dir, 1, 2, settings);
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->has_value());
  // Asking for sparse without budgets is a config error, not a silent dense fallback.
  settings.enabled = true;
  c = LoadSparseAttentionConfig(dir, 1, 2, settings);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            absl::StrCat("dual_chunk_attention_config.sparse_attention_enabled is true but ", dir,
                         "/sparse_attention_config.json does not exist; sparse prefill needs its "
                         "per-head budgets"));
}

TEST(LoadSparseAttentionConfigTest, UnreadableAndMalformedFiles) {
  const std::string dir = TempDir("pattern_is_a_dir");
  mkdir((dir + "/sparse_attention_config.json").c_str(), 0755);
  absl::StatusOr<std::optional<SparseAttentionConfig>> c =
      LoadSparseAttentionConfig(dir, 1, 2, SparseSettings());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            absl::StrCat(dir,
                         "/sparse_attention_config.json: cannot read the sparse attention "
                         "config: not a regular file"));

  const std::string dir2 = TempDir("bad_pattern");
  WriteFile(dir2 + "/sparse_attention_config.json",
            OneLayer({{"0", Entry(30, 100)}, {"1", "[\"block_sparse\", 1, 2, 3]"}}));
  c = LoadSparseAttentionConfig(dir2, 1, 2, SparseSettings());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            absl::StrCat(dir2,
                         "/sparse_attention_config.json: layer 0 head \"1\": unknown pattern "
                         "type \"block_sparse\" (only \"vertical_and_slash\" is supported)"));
}

TEST(LoadSparseAttentionConfigTest, ShippedQwen7BPattern) {
  absl::StatusOr<std::optional<SparseAttentionConfig>> c =
      LoadSparseAttentionConfig("configs/qwen2.5-7b-instruct-1m", 28, 28, SparseSettings());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_value());
  ASSERT_EQ((*c)->budgets.size(), 28u * 28u);
  // Budgets from the published Qwen2.5-7B-Instruct-1M pattern's value set
  // (configs/qwen2.5-7b-instruct-1m), (1000, 6096) the commonest; 30 read as 130.
  const std::vector<std::pair<int64_t, int64_t>> allowed = {
      {1000, 6096},   {130, 800},     {100, 800},     {500, 700},    {3500, 100},
      {3048, 8144},   {5096, 10192},  {7244, 12240},  {9192, 14288}, {11340, 16336},
      {13388, 18384}, {15436, 20432}, {19532, 24528}, {22032, 18532}};
  std::map<std::pair<int64_t, int64_t>, int> counts;
  for (const VsBudget& b : (*c)->budgets) {
    const std::pair<int64_t, int64_t> key(b.vertical, b.slash);
    EXPECT_NE(std::find(allowed.begin(), allowed.end(), key), allowed.end())
        << b.vertical << ", " << b.slash;
    ++counts[key];
  }
  const auto commonest =
      std::max_element(counts.begin(), counts.end(),
                       [](const auto& a, const auto& b) { return a.second < b.second; });
  EXPECT_EQ(commonest->first, (std::pair<int64_t, int64_t>(1000, 6096)));
  EXPECT_TRUE((*c)->enabled);
}

TEST(LoadSparseAttentionConfigTest, ShippedTinySparse) {
  absl::StatusOr<std::optional<SparseAttentionConfig>> c =
      LoadSparseAttentionConfig("configs/tiny-sparse", 1, 4, SparseSettings());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_value());
  EXPECT_EQ((*c)->layer(0)[0].vertical, 130);
}

}  // namespace
}  // namespace attnd
