// The sparse CPU kernel alone against the golden case sparse_vs (tests/testdata/dca, produced by
// running the reference backend): its 1100-token prefill over three DCA chunks within 1e-4, with
// fp32 and bf16 KV storage (the inputs are exact in bf16). The case's third piece uses the
// stage fallback lists, so this also pins their values (kernels/vertical_slash.h). The case
// comes in through the test's runfiles (//tests/testdata:dca).
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/dca_cpu.h"
#include "kernels/paged_kv.h"
#include "kernels/sparse_prefill_cpu.h"
#include "kernels/vertical_slash.h"
#include "nlohmann/json.hpp"
#include "tests/testdata/golden_dir.h"

namespace attnd {
namespace {

template <typename KvT>
void ReplayPrefill(const nlohmann::json& c, const std::string& blob) {
  auto get = [&](const std::string& name) {
    const nlohmann::json& e = c.at("tensors").at(name);
    const DType dt = e.at("dtype") == "bf16" ? DType::kBf16 : DType::kFp32;
    std::vector<float> v(e.at("nbytes").get<size_t>() / ElementSize(dt));
    ConvertToFloat(blob.data() + e.at("offset").get<size_t>(), dt, v.size(), v.data());
    return v;
  };
  const nlohmann::json& dca = c.at("dual_chunk_attention_config");
  DcaGeometry g;
  g.num_q_heads = c.at("num_q_heads");
  g.num_kv_heads = c.at("num_kv_heads");
  g.head_dim = c.at("head_dim");
  g.chunk_len = dca.at("chunk_size").get<int64_t>() - dca.at("local_size").get<int64_t>();
  g.original_max_position_embeddings = dca.at("original_max_position_embeddings");
  g.softmax_scale = c.at("softmax_scale").get<float>();
  // The case's budgets, read as the loader reads them (vertical 30 -> 130).
  std::vector<VsBudget> budgets(g.num_q_heads);
  for (const auto& [head, entry] : dca.at("sparse_attention_config").at(0).items()) {
    ASSERT_EQ(entry.at(0), "vertical_and_slash");
    VsBudget& b = budgets.at(std::stoi(head));
    const int64_t vertical = entry.at(1), slash = entry.at(2);
    b.vertical = vertical == 30 ? 130 : vertical;
    b.slash = slash;
  }
  const nlohmann::json& step = c.at("steps").at(0);
  ASSERT_EQ(step.at("op"), "prefill");
  ASSERT_EQ(step.at("start"), 0);
  const int64_t t = step.at("tokens"), prompt = step.at("prompt_len");
  ASSERT_GT(prompt, dca.at("sparse_attention_threshold").get<int64_t>());
  const std::vector<float> q = get(step.at("q")), k = get(step.at("k")), v = get(step.at("v"));
  const std::vector<float> want = get(step.at("out"));

  constexpr int32_t kPage = 16;
  const int64_t pages = (t + kPage - 1) / kPage;
  std::vector<KvT> kbuf(pages * kPage * g.num_kv_heads * g.head_dim);
  std::vector<KvT> vbuf(kbuf.size());
  std::vector<int32_t> table(pages);
  std::iota(table.rbegin(), table.rend(), 0);  // pages in reverse order
  const PagedKv<KvT> kv{kbuf.data(), vbuf.data(), table.data(), kPage, g.num_kv_heads, g.head_dim};
  ThreadPool pool(2);
  const float s = LengthScale(prompt, g.original_max_position_embeddings);
  CpuAppendParams ap;
  ap.k = k.data();
  ap.v = v.data();
  ap.num_tokens = t;
  ap.key_scale = s;
  AppendKvCpu<KvT>(kv, ap, &pool);
  std::vector<float> out(want.size());
  CpuPrefillParams p;
  p.q = q.data();
  p.out = out.data();
  p.num_tokens = t;
  p.softmax_scale = g.softmax_scale * s;
  DcaSparsePrefillCpu<KvT>(g, kv, p, budgets, dca.at("sparse_attention_last_q"), &pool);
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(std::isfinite(out[i])) << i;
    worst = std::max(worst, static_cast<double>(std::fabs(out[i] - want[i])));
  }
  EXPECT_LE(worst, 1e-4);

  // The dense kernel on the same cache is far off: the case really depends on the sparse pattern.
  DcaPrefillCpu<KvT>(g, kv, p, &pool);
  double dense_worst = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    dense_worst = std::max(dense_worst, static_cast<double>(std::fabs(out[i] - want[i])));
  }
  EXPECT_GT(dense_worst, 1e-2);
}

class SparseGoldenCpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = testing::GoldenCaseDir("sparse_vs");
    ASSERT_TRUE(std::ifstream(dir + "/case.json").good())
        << "no golden case in " << dir << " (//tests/testdata:dca in the test's data)";
    std::ifstream json_file(dir + "/case.json");
    case_ = nlohmann::json::parse(json_file, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(case_.is_discarded());
    std::stringstream buffer;
    buffer << std::ifstream(dir + "/tensors.bin", std::ios::binary).rdbuf();
    blob_ = buffer.str();
    ASSERT_FALSE(blob_.empty());
  }
  nlohmann::json case_;
  std::string blob_;
};

TEST_F(SparseGoldenCpuTest, PrefillFp32Kv) { ReplayPrefill<float>(case_, blob_); }
TEST_F(SparseGoldenCpuTest, PrefillBf16Kv) { ReplayPrefill<uint16_t>(case_, blob_); }

}  // namespace
}  // namespace attnd
