// The CUDA engine with a one-byte KV cache, int8 and fp8 E4M3 alike (docs/kv_cache.md, "CUDA"):
//  - against the CPU engine of the same KV dtype on the same random inputs (chunked dense prefill,
//    a pre-rotary sequence, batched decode; bf16/fp16/fp32 requests): outputs within the bf16
//    kernels' bar of the CPU's (max abs 2e-2, mean abs 2e-3: the CUDA prefill rounds q, the
//    dequantised K/V and the softmax weights to bf16, its decode q and the weights to fp16, the CPU
//    keeps fp32), and every stored code and scale equal to base/int8_kv.h's Int8QuantizeRow (or
//    base/fp8.h's Fp8QuantizeRow) of the same fp32 rows, bit for bit;
//  - CUDA graphs on and off: outputs and pools bit for bit;
//  - against a bf16 CUDA engine fed the pool's dequantised values bf16(value * scale) (no length
//    scaling, so the bf16 pool stores them as they are): dense and sparse prefill bit for bit,
//    which pins the prefill scratch to the bf16 kernels' results; decode (fp16 on the codes' exact
//    values, the scales applied to scores and weights) within the bf16 kernels' bar;
//  - the golden DCA cases at the CPU test's bars for the dtype (cpu_engine_kv_accuracy_test.cc).
// Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/fp8.h"
#include "base/int8_kv.h"
#include "gtest/gtest.h"
#include "kernels/cuda/testing/gpu_test.h"
#include "kernels/dca.h"
#include "kvcache/kv_layout.h"
#include "server/config/sparse_config.h"
#include "server/engine/cpu_engine.h"
#include "server/engine/cuda_engine.h"
#include "server/engine/engine.h"
#include "server/engine/engine_jobs_for_testing.h"
#include "server/engine/engine_tensors_for_testing.h"
#include "server/engine/kv_golden_replay_for_testing.h"

namespace attnd {
namespace {

using engine_testing::ExpectClose;
using engine_testing::FromValues;
using engine_testing::RandomTensor;
using engine_testing::Tensor;

// A prefill of tokens [start, start + q's tokens) of one sequence on `pages`, fp32 output.
PrefillJob PrefillOf(const std::vector<int32_t>& pages, int64_t start, int64_t prompt_len,
                     const Tensor& q, const Tensor& k, const Tensor& v, float* out,
                     QLayout layout = QLayout::kVariants) {
  PrefillJob job = EngineJobsForTesting::Prefill();
  job.page_table = pages.data();
  job.num_pages = static_cast<int64_t>(pages.size());
  job.start = start;
  job.num_tokens = k.shape[0];
  job.prompt_len = prompt_len;
  job.q_layout = layout;
  job.q = q.view();
  job.k = k.view();
  job.v = v.view();
  job.out = out;
  job.out_dtype = DType::kFp32;
  return job;
}

// A decode entry of one sequence on `pages` at `length` (the new token included), fp32 output.
DecodeJob::Entry DecodeOf(const std::vector<int32_t>& pages, int64_t length, const Tensor& q,
                          const Tensor& k, const Tensor& v, float* out,
                          QLayout layout = QLayout::kVariants) {
  DecodeJob::Entry en;
  en.page_table = pages.data();
  en.num_pages = static_cast<int64_t>(pages.size());
  en.length = length;
  en.q_layout = layout;
  en.q = q.view();
  en.k = k.view();
  en.v = v.view();
  en.out = out;
  en.out_dtype = DType::kFp32;
  return en;
}

// A row's codes and scale as the CPU engine stores them for `dtype` (int8 or fp8), and back.
float QuantizeRowAs(DType dtype, const float* src, float multiplier, int n, uint8_t* codes) {
  if (dtype == DType::kFp8E4m3) {
    return Fp8QuantizeRow(src, multiplier, n, reinterpret_cast<Fp8E4m3*>(codes));
  }
  return Int8QuantizeRow(src, multiplier, n, reinterpret_cast<Int8Kv*>(codes));
}
void DequantizeRowAs(DType dtype, const uint8_t* codes, float scale, int n, float* dst) {
  if (dtype == DType::kFp8E4m3) {
    Fp8DequantizeRow(reinterpret_cast<const Fp8E4m3*>(codes), scale, n, dst);
  } else {
    Int8DequantizeRow(reinterpret_cast<const Int8Kv*>(codes), scale, n, dst);
  }
}

// The KV dtypes under test, named for the test's instances.
class CudaEngineOneByteKv : public ::testing::TestWithParam<DType> {};
std::string KvName(const ::testing::TestParamInfo<DType>& info) {
  return info.param == DType::kFp8E4m3 ? "fp8" : "int8";
}

// One stored row: the fp32 values the engine was given and the multiplier it applies (s(L) for a
// key, 1 for a value), and where it lives.
struct StoredRow {
  int32_t layer, head;
  int32_t page, slot;
  bool is_key;
  std::vector<float> values;
  float multiplier;
};

// Every recorded row's codes and scale in `pool` equal the CPU's quantisation of it for the
// layout's dtype; returns the rows checked.
size_t ExpectPoolRows(const std::vector<uint8_t>& pool, const KvLayout& layout,
                      const std::vector<StoredRow>& rows) {
  const int d = layout.head_dim;
  std::vector<uint8_t> codes(d);
  size_t mismatched = 0;
  for (const StoredRow& r : rows) {
    const float scale =
        QuantizeRowAs(layout.kv_dtype, r.values.data(), r.multiplier, d, codes.data());
    const int64_t index =
        (int64_t{r.page} * layout.page_size + r.slot) * layout.num_kv_heads + r.head;
    const int64_t data =
        (r.is_key ? layout.k_offset(r.layer) : layout.v_offset(r.layer)) + index * d;
    const int64_t scale_at =
        (r.is_key ? layout.k_scale_offset(r.layer) : layout.v_scale_offset(r.layer)) + index * 4;
    float got_scale;
    std::memcpy(&got_scale, pool.data() + scale_at, 4);
    const bool same = std::memcmp(&got_scale, &scale, 4) == 0 &&
                      std::memcmp(pool.data() + data, codes.data(), d) == 0;
    if (!same && ++mismatched <= 5) {
      ADD_FAILURE() << (r.is_key ? "key" : "value") << " row layer " << r.layer << " page "
                    << r.page << " slot " << r.slot << " head " << r.head << ": scale " << got_scale
                    << " (want " << scale << ") or codes differ";
    }
  }
  EXPECT_EQ(mismatched, 0u);
  return rows.size();
}

DcaGeometry RotaryGeometry() {
  DcaGeometry g;
  g.num_q_heads = 28;
  g.num_kv_heads = 4;
  g.head_dim = 128;
  g.chunk_len = 64;
  g.chunk_size = g.chunk_len + 16;
  g.original_max_position_embeddings = 100;  // keys length-scaled past 100 tokens
  g.softmax_scale = 1.f / std::sqrt(128.f);
  g.rope_theta = 10000.0;
  g.rotary_dim = 128;
  return g;
}

TEST_P(CudaEngineOneByteKv, MatchesTheCpuEngineAndStoresItsCodes) {
  REQUIRE_GPU();
  CudaEngineOptions opts;
  opts.geometry = RotaryGeometry();
  opts.layout.num_layers = 2;
  opts.layout.num_kv_heads = 4;
  opts.layout.head_dim = 128;
  opts.layout.page_size = 16;
  opts.layout.kv_dtype = GetParam();
  opts.layout.num_pages = 160;
  opts.max_decode_batch = 2;  // a 4-entry decode runs as 2 + 2
  opts.graph_batch_sizes = {1, 2};
  opts.staging_bytes = int64_t{90112} * 48;  // 48-token prefill chunks
  CudaEngineOptions eager = opts;
  eager.cuda_graphs = false;
  auto graphs_engine = CreateCudaEngine(opts);
  ASSERT_TRUE(graphs_engine.ok()) << graphs_engine.status();
  auto eager_engine = CreateCudaEngine(eager);
  ASSERT_TRUE(eager_engine.ok()) << eager_engine.status();
  EXPECT_TRUE((*graphs_engine)->decode_graphs());
  EXPECT_EQ((*graphs_engine)->layout().kv_dtype, GetParam());
  CpuEngineOptions cpu_opts;
  cpu_opts.geometry = opts.geometry;
  cpu_opts.layout = opts.layout;
  cpu_opts.compute_threads = 2;
  auto cpu = CpuEngine::Create(cpu_opts);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  Engine* engines[] = {graphs_engine->get(), eager_engine->get(), cpu->get()};

  const DcaGeometry g = opts.geometry;
  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  const int32_t ps = opts.layout.page_size;
  std::mt19937 rng(11);
  struct Seq {
    std::vector<int64_t> chunks;
    DType in;
    bool pre_rotary;
    std::vector<int32_t> pages;
    int64_t length = 0;
  };
  std::vector<Seq> seqs = {{{300}, DType::kBf16, false},         // > 6 staging chunks
                           {{1}, DType::kFp32, false},           // one token
                           {{100, 29, 3}, DType::kFp16, false},  // chunked, page edges
                           {{70, 40}, DType::kBf16, true}};      // pre-rotary
  std::vector<int32_t> perm(opts.layout.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  size_t next = 0;
  for (Seq& s : seqs) {
    const int64_t prompt = std::accumulate(s.chunks.begin(), s.chunks.end(), int64_t{0});
    const int64_t pages = (prompt + 3 + ps - 1) / ps;
    s.pages.assign(perm.begin() + next, perm.begin() + next + pages);
    next += pages;
  }
  // The rows whose bytes the pool must hold (pre-rotary keys are rotated on each backend by its
  // own arithmetic, so only their values are pinned).
  std::vector<StoredRow> rows;
  auto record = [&](const Seq& s, int32_t layer, int64_t pos, const float* k, const float* v,
                    float key_scale) {
    const int32_t page = s.pages[pos / ps], slot = static_cast<int32_t>(pos % ps);
    for (int32_t h = 0; h < hkv; ++h) {
      if (!s.pre_rotary) {
        rows.push_back({layer, h, page, slot, true, std::vector<float>(k + h * d, k + (h + 1) * d),
                        key_scale});
      }
      rows.push_back(
          {layer, h, page, slot, false, std::vector<float>(v + h * d, v + (h + 1) * d), 1.f});
    }
  };

  for (int32_t layer = 0; layer < 2; ++layer) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      const int64_t prompt = std::accumulate(s.chunks.begin(), s.chunks.end(), int64_t{0});
      int64_t start = 0;
      for (int64_t t : s.chunks) {
        const Tensor q = s.pre_rotary ? RandomTensor({t, hq, d}, s.in, &rng)
                                      : RandomTensor({t, kNumQueryVariants, hq, d}, s.in, &rng);
        const Tensor k = RandomTensor({t, hkv, d}, s.in, &rng);
        const Tensor v = RandomTensor({t, hkv, d}, s.in, &rng);
        std::vector<std::vector<float>> outs;
        for (Engine* e : engines) {
          outs.emplace_back(t * hq * d, std::nanf(""));
          PrefillJob job = PrefillOf(s.pages, start, prompt, q, k, v, outs.back().data(),
                                     s.pre_rotary ? QLayout::kPreRotary : QLayout::kVariants);
          job.layer = layer;
          const absl::Status st = e->Prefill(job);
          ASSERT_TRUE(st.ok()) << st;
        }
        const std::string what =
            absl::StrCat("prefill seq", i, " layer", layer, " [", start, ",", start + t, ")");
        EXPECT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4), 0)
            << what << ": graphs on and off differ";
        // A pre-rotary key is rotated by each backend's own arithmetic (fp32, different
        // order), so an element near a rounding boundary can take the neighbouring code: 1/127 of
        // the row's largest value for int8, but up to 1/16 of the element for E4M3, which then
        // differs like fp8 against exact keys. Those prefills get fp8's golden envelope on
        // dense_pre_rotary (cpu_engine_kv_accuracy_test.cc); every other output the bf16 bar.
        const bool flips = s.pre_rotary && GetParam() == DType::kFp8E4m3;
        ExpectClose(outs[0], outs[2], what + " cuda vs cpu", flips ? 0.15 : 2e-2,
                    flips ? 6e-3 : 2e-3);
        const float key_scale = LengthScale(prompt, g.original_max_position_embeddings);
        for (int64_t j = 0; j < t; ++j) {
          record(s, layer, start + j, k.values.data() + j * hkv * d, v.values.data() + j * hkv * d,
                 key_scale);
        }
        start += t;
      }
      s.length = start;
    }
  }

  for (int step = 0; step < 3; ++step) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      std::vector<Tensor> qs, ks, vs;
      for (const Seq& s : seqs) {
        qs.push_back(s.pre_rotary ? RandomTensor({hq, d}, s.in, &rng)
                                  : RandomTensor({kNumQueryVariants, hq, d}, s.in, &rng));
        ks.push_back(RandomTensor({hkv, d}, s.in, &rng));
        vs.push_back(RandomTensor({hkv, d}, s.in, &rng));
      }
      std::vector<std::vector<float>> outs;
      for (Engine* e : engines) {
        outs.emplace_back(seqs.size() * hq * d, std::nanf(""));
        DecodeJob job = EngineJobsForTesting::Decode();
        job.layer = layer;
        for (size_t i = 0; i < seqs.size(); ++i) {
          job.entries.push_back(
              DecodeOf(seqs[i].pages, seqs[i].length + step + 1, qs[i], ks[i], vs[i],
                       outs.back().data() + i * hq * d,
                       seqs[i].pre_rotary ? QLayout::kPreRotary : QLayout::kVariants));
        }
        const absl::Status st = e->Decode(job).status();
        ASSERT_TRUE(st.ok()) << st;
      }
      const std::string what = absl::StrCat("decode step", step, " layer", layer);
      EXPECT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4), 0)
          << what << ": graphs on and off differ";
      ExpectClose(outs[0], outs[2], what + " cuda vs cpu");
      for (size_t i = 0; i < seqs.size(); ++i) {
        const int64_t len = seqs[i].length + step + 1;
        record(seqs[i], layer, len - 1, ks[i].values.data(), vs[i].values.data(),
               LengthScale(len, g.original_max_position_embeddings));
      }
    }
  }

  auto pool_graphs = CopyCudaPoolForTesting(**graphs_engine);
  ASSERT_TRUE(pool_graphs.ok()) << pool_graphs.status();
  auto pool_eager = CopyCudaPoolForTesting(**eager_engine);
  ASSERT_TRUE(pool_eager.ok()) << pool_eager.status();
  ASSERT_EQ(pool_graphs->size(), static_cast<size_t>(opts.layout.pool_bytes()));
  EXPECT_TRUE(*pool_graphs == *pool_eager) << "graphs on and off stored different bytes";
  const size_t checked = ExpectPoolRows(*pool_graphs, opts.layout, rows);
  std::printf("  %zu stored rows equal the CPU's %s codes and scales\n", checked,
              std::string(DTypeName(GetParam())).c_str());
  EXPECT_GT(checked, 1000u);
  EXPECT_FALSE(CopyCudaPoolForTesting(**cpu).ok());
}

// One layer, 28 q heads; a mix of the shipped 7B budgets (as cuda_engine_sparse_test.cc).
std::shared_ptr<const SparseAttentionConfig> Sparse(int64_t threshold) {
  auto sp = std::make_shared<SparseAttentionConfig>();
  sp->source = "test";
  sp->num_layers = 1;
  sp->num_q_heads = 28;
  sp->enabled = true;
  sp->threshold = threshold;
  sp->last_q = 64;
  const VsBudget mix[] = {{1000, 6096}, {3500, 100},  {100, 60}, {15436, 20432},
                          {50, 70},     {1000, 6096}, {130, 80}, {5096, 10192}};
  for (int h = 0; h < 28; ++h) sp->budgets.push_back(mix[h % 8]);
  return sp;
}

TEST_P(CudaEngineOneByteKv, EqualsBf16OverTheDequantizedValues) {
  REQUIRE_GPU();
  CudaEngineOptions opts;
  opts.geometry.num_q_heads = 28;
  opts.geometry.num_kv_heads = 4;
  opts.geometry.head_dim = 128;
  opts.geometry.chunk_len = 256;
  opts.geometry.original_max_position_embeddings = 1 << 20;  // s(L) = 1: keys stored as given
  opts.geometry.softmax_scale = 1.f / std::sqrt(128.f);
  opts.layout.num_layers = 1;
  opts.layout.num_kv_heads = 4;
  opts.layout.head_dim = 128;
  opts.layout.page_size = 16;
  opts.layout.kv_dtype = GetParam();
  opts.layout.num_pages = 128;
  opts.max_decode_batch = 4;
  opts.staging_bytes = int64_t{90112} * 192;
  opts.sparse = Sparse(/*threshold=*/400);
  CudaEngineOptions bf16_opts = opts;
  bf16_opts.layout.kv_dtype = DType::kBf16;
  auto codes_engine = CreateCudaEngine(opts);
  ASSERT_TRUE(codes_engine.ok()) << codes_engine.status();
  auto bf16_engine = CreateCudaEngine(bf16_opts);
  ASSERT_TRUE(bf16_engine.ok()) << bf16_engine.status();
  const KvLayout& layout = opts.layout;
  const int64_t hq = 28, hkv = 4, d = 128;
  const int32_t ps = layout.page_size;
  std::mt19937 rng(3);

  // Sequence 0 takes the sparse path (prompt 700 > 400, three DCA pieces), sequence 1 the dense.
  const std::vector<int64_t> prompts = {700, 300};
  constexpr int kSteps = 2;
  std::vector<std::vector<int32_t>> pages(2);
  for (int32_t p = 0; p < layout.num_pages; ++p) pages[p % 2].push_back(p);  // interleaved
  std::vector<Tensor> pq, pk, pv;  // prefill inputs per sequence
  std::vector<std::vector<Tensor>> dq(kSteps), dk(kSteps), dv(kSteps);
  for (int64_t prompt : prompts) {
    pq.push_back(RandomTensor({prompt, kNumQueryVariants, hq, d}, DType::kBf16, &rng));
    pk.push_back(RandomTensor({prompt, hkv, d}, DType::kBf16, &rng));
    pv.push_back(RandomTensor({prompt, hkv, d}, DType::kBf16, &rng));
  }
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < prompts.size(); ++i) {
      dq[s].push_back(RandomTensor({kNumQueryVariants, hq, d}, DType::kFp32, &rng));
      dk[s].push_back(RandomTensor({hkv, d}, DType::kFp32, &rng));
      dv[s].push_back(RandomTensor({hkv, d}, DType::kFp32, &rng));
    }
  }
  // Runs the script on `e` with keys and values from k_of / v_of; returns every output.
  auto run = [&](Engine& e, const std::vector<Tensor>& ks, const std::vector<Tensor>& vs,
                 const std::vector<std::vector<Tensor>>& step_k,
                 const std::vector<std::vector<Tensor>>& step_v) {
    std::vector<float> all;
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::vector<float> out(prompts[i] * hq * d, std::nanf(""));
      const absl::Status st =
          e.Prefill(PrefillOf(pages[i], 0, prompts[i], pq[i], ks[i], vs[i], out.data()));
      EXPECT_TRUE(st.ok()) << st;
      all.insert(all.end(), out.begin(), out.end());
    }
    for (int s = 0; s < kSteps; ++s) {
      std::vector<float> out(prompts.size() * hq * d, std::nanf(""));
      DecodeJob job = EngineJobsForTesting::Decode();
      for (size_t i = 0; i < prompts.size(); ++i) {
        job.entries.push_back(DecodeOf(pages[i], prompts[i] + s + 1, dq[s][i], step_k[s][i],
                                       step_v[s][i], out.data() + i * hq * d));
      }
      const absl::Status st = e.Decode(job).status();
      EXPECT_TRUE(st.ok()) << st;
      all.insert(all.end(), out.begin(), out.end());
    }
    return all;
  };
  const std::vector<float> got = run(**codes_engine, pk, pv, dk, dv);
  auto pool = CopyCudaPoolForTesting(**codes_engine);
  ASSERT_TRUE(pool.ok()) << pool.status();
  // The dequantised rows bf16(value * scale) of position `pos` of sequence i, all kv heads.
  auto dequantized = [&](size_t i, int64_t pos, bool key) {
    std::vector<float> row(hkv * d);
    const int64_t page = pages[i][pos / ps], slot = pos % ps;
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t index = (page * ps + slot) * hkv + h;
      float scale;
      std::memcpy(
          &scale,
          pool->data() + (key ? layout.k_scale_offset(0) : layout.v_scale_offset(0)) + index * 4,
          4);
      DequantizeRowAs(layout.kv_dtype,
                      pool->data() + (key ? layout.k_offset(0) : layout.v_offset(0)) + index * d,
                      scale, d, row.data() + h * d);
    }
    return row;
  };
  std::vector<Tensor> qk, qv;
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::vector<float> k, v;
    for (int64_t pos = 0; pos < prompts[i]; ++pos) {
      const std::vector<float> kr = dequantized(i, pos, true), vr = dequantized(i, pos, false);
      k.insert(k.end(), kr.begin(), kr.end());
      v.insert(v.end(), vr.begin(), vr.end());
    }
    qk.push_back(FromValues({prompts[i], hkv, d}, DType::kBf16, k));
    qv.push_back(FromValues({prompts[i], hkv, d}, DType::kBf16, v));
  }
  std::vector<std::vector<Tensor>> sk(kSteps), sv(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < prompts.size(); ++i) {
      sk[s].push_back(FromValues({hkv, d}, DType::kBf16, dequantized(i, prompts[i] + s, true)));
      sv[s].push_back(FromValues({hkv, d}, DType::kBf16, dequantized(i, prompts[i] + s, false)));
    }
  }
  const std::vector<float> want = run(**bf16_engine, qk, qv, sk, sv);
  ASSERT_EQ(got.size(), want.size());
  const size_t prefill_outputs =
      static_cast<size_t>(std::accumulate(prompts.begin(), prompts.end(), int64_t{0}) * hq * d);
  size_t differ = 0;
  for (size_t i = 0; i < prefill_outputs; ++i) differ += std::memcmp(&got[i], &want[i], 4) != 0;
  EXPECT_EQ(differ, 0u) << "of " << prefill_outputs << " prefill outputs";
  for (float x : got) ASSERT_TRUE(std::isfinite(x));
  ExpectClose(std::vector<float>(got.begin() + prefill_outputs, got.end()),
              std::vector<float>(want.begin() + prefill_outputs, want.end()),
              "decode vs bf16 over the dequantised values");
}

// The one-byte decode's fp16 paths at their edges, against the CPU engine of the same dtype: a GQA
// group of 16 (the mma rows 8..15 carry heads), head_dim 64, steps crossing DCA chunks (every
// variant), and queries far outside fp16's range (|q| up to ~2.6e5, the softmax scale shrunk to
// match), which the kernel's per-row power-of-two factor must bring into range: without it they
// overflow to inf; then queries of ~1e-35 (a factor for them alone would overflow fp32; their
// scores are ~0).
TEST_P(CudaEngineOneByteKv, DecodeOfAWideGroupAndLargeQueriesMatchesTheCpu) {
  REQUIRE_GPU();
  constexpr float kQueryGain = 65536.f;
  CudaEngineOptions opts;
  opts.geometry.num_q_heads = 32;
  opts.geometry.num_kv_heads = 2;
  opts.geometry.head_dim = 64;
  opts.geometry.chunk_len = 64;
  opts.geometry.chunk_size = 80;
  opts.geometry.original_max_position_embeddings = 100;
  opts.geometry.softmax_scale = 0.125f / kQueryGain;
  opts.layout.num_layers = 1;
  opts.layout.num_kv_heads = 2;
  opts.layout.head_dim = 64;
  opts.layout.page_size = 16;
  opts.layout.kv_dtype = GetParam();
  opts.layout.num_pages = 64;
  opts.max_decode_batch = 2;
  auto cuda = CreateCudaEngine(opts);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  CpuEngineOptions cpu_opts;
  cpu_opts.geometry = opts.geometry;
  cpu_opts.layout = opts.layout;
  cpu_opts.compute_threads = 2;
  auto cpu = CpuEngine::Create(cpu_opts);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const int64_t hq = 32, hkv = 2, d = 64;
  std::mt19937 rng(5);
  auto scaled = [&](std::vector<int64_t> shape, float gain) {
    Tensor t = RandomTensor(shape, DType::kBf16, &rng);
    for (float& x : t.values) x *= gain;
    return FromValues(std::move(shape), DType::kBf16, t.values);
  };
  const std::vector<int64_t> prompts = {300, 129};
  std::vector<std::vector<int32_t>> pages(2);
  for (int32_t p = 0; p < 44; ++p) pages[p % 2].push_back(p);
  Engine* engines[] = {cuda->get(), cpu->get()};
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Tensor q = RandomTensor({prompts[i], kNumQueryVariants, hq, d}, DType::kBf16, &rng);
    const Tensor k = RandomTensor({prompts[i], hkv, d}, DType::kBf16, &rng);
    const Tensor v = RandomTensor({prompts[i], hkv, d}, DType::kBf16, &rng);
    for (Engine* e : engines) {
      std::vector<float> out(prompts[i] * hq * d);
      ASSERT_TRUE(e->Prefill(PrefillOf(pages[i], 0, prompts[i], q, k, v, out.data())).ok());
    }
  }
  const float gains[] = {kQueryGain, kQueryGain, kQueryGain, 1e-35f};
  for (int step = 0; step < 4; ++step) {
    std::vector<Tensor> qs, ks, vs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      qs.push_back(scaled({kNumQueryVariants, hq, d}, gains[step]));
      ks.push_back(RandomTensor({hkv, d}, DType::kBf16, &rng));
      vs.push_back(RandomTensor({hkv, d}, DType::kBf16, &rng));
    }
    std::vector<std::vector<float>> outs;
    for (Engine* e : engines) {
      outs.emplace_back(prompts.size() * hq * d, std::nanf(""));
      DecodeJob job = EngineJobsForTesting::Decode();
      for (size_t i = 0; i < prompts.size(); ++i) {
        job.entries.push_back(DecodeOf(pages[i], prompts[i] + step + 1, qs[i], ks[i], vs[i],
                                       outs.back().data() + i * hq * d));
      }
      const absl::Status st = e->Decode(job).status();
      ASSERT_TRUE(st.ok()) << st;
    }
    ExpectClose(outs[0], outs[1],
                absl::StrCat("group 16, |q| ~ ", gains[step], ", decode step ", step));
  }
}

INSTANTIATE_TEST_SUITE_P(KvDTypes, CudaEngineOneByteKv,
                         ::testing::Values(DType::kInt8, DType::kFp8E4m3), KvName);

// The golden cases through the CUDA engine with one-byte KV, held to the CPU test's bars.
struct GoldenBar {
  const char* name;
  DType kv_dtype;
  double max_abs, mean_abs;
};
class CudaOneByteKvGoldenTest : public ::testing::TestWithParam<GoldenBar> {};

TEST_P(CudaOneByteKvGoldenTest, MeetsTheCpuBars) {
  REQUIRE_GPU();
  const GoldenBar& bar = GetParam();
  kv_golden::Golden c;
  ASSERT_TRUE(kv_golden::LoadGolden(bar.name, &c)) << "no golden case " << bar.name;
  const auto make = [](const DcaGeometry& g, std::shared_ptr<const SparseAttentionConfig> sparse,
                       const KvLayout& layout) {
    CudaEngineOptions o;
    o.geometry = g;
    o.layout = layout;
    o.sparse = std::move(sparse);
    o.max_decode_batch = 16;
    o.graph_batch_sizes = {1, 2, 4, 8, 16};
    return CreateCudaEngine(o);
  };
  const kv_golden::Replay r = kv_golden::ReplayCase(c, bar.kv_dtype, make);
  ASSERT_FALSE(r.got.empty());
  const kv_golden::Errors e = kv_golden::Measure(r.got, r.want);
  std::printf("golden %-18s cuda %s KV %zu outputs: max %.3g mean %.3g (%zu over %.0e)\n", bar.name,
              std::string(DTypeName(bar.kv_dtype)).c_str(), r.got.size(), e.max_abs, e.mean_abs,
              e.over_target, kv_golden::kTargetMaxAbs);
  EXPECT_TRUE(e.finite);
  EXPECT_LE(e.max_abs, bar.max_abs);
  EXPECT_LE(e.mean_abs, bar.mean_abs);
}

// cpu_engine_kv_accuracy_test.cc's bars. int8: the target on the dense cases; on sparse_vs the
// target's mean and the CPU's measured max with a margin (the pattern is estimated from rounded
// keys, here also rounded to bf16 in the prefill scratch). fp8: the CPU's measured envelope per
// case (E4M3's 3 mantissa bits miss the target on the CPU too; that test says why).
INSTANTIATE_TEST_SUITE_P(
    Cases, CudaOneByteKvGoldenTest,
    ::testing::Values(GoldenBar{"dense_gqa_chunked", DType::kInt8, 4e-2, 4e-3},
                      GoldenBar{"dense_pre_rotary", DType::kInt8, 4e-2, 4e-3},
                      GoldenBar{"sparse_vs", DType::kInt8, 0.45, 4e-3},
                      GoldenBar{"dense_gqa_chunked", DType::kFp8E4m3, 0.12, 5.5e-3},
                      GoldenBar{"dense_pre_rotary", DType::kFp8E4m3, 0.15, 6e-3},
                      GoldenBar{"sparse_vs", DType::kFp8E4m3, 0.55, 5.5e-3}),
    [](const ::testing::TestParamInfo<GoldenBar>& info) {
      return absl::StrCat(info.param.name, "_",
                          info.param.kv_dtype == DType::kFp8E4m3 ? "fp8" : "int8");
    });

}  // namespace
}  // namespace attnd
