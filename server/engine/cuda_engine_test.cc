// CudaEngine against the fp64 reference (//kernels/testing:naive_dca): chunked prefill in two
// layers for several sequences, then decode steps over a mixed batch, with bf16/fp16/fp32 requests
// and outputs, a pool with shuffled pages, tiny staging (forces chunking) and a small decode batch
// cap (forces batching). Error paths are checked by code and message. GPU parts skip loudly without
// a CUDA device; the option checks run everywhere.
#include "server/engine/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cuda/testing/gpu_test.h"
#include "kernels/dca.h"
#include "kernels/testing/naive_dca.h"
#include "kvcache/kv_layout.h"
#include "server/engine/engine.h"
#include "server/engine/engine_jobs_for_testing.h"
#include "server/engine/engine_tensors_for_testing.h"

namespace attnd {
namespace {

DcaGeometry TestGeometry() {
  DcaGeometry g;
  g.num_q_heads = 28;
  g.num_kv_heads = 4;
  g.head_dim = 128;
  g.chunk_len = 64;
  g.original_max_position_embeddings = 100;  // scaling on past 100 tokens
  g.softmax_scale = 1.f / std::sqrt(128.f);
  return g;
}

CudaEngineOptions TestOptions() {
  CudaEngineOptions o;
  o.geometry = TestGeometry();
  o.layout.num_layers = 2;
  o.layout.num_kv_heads = 4;
  o.layout.head_dim = 128;
  o.layout.page_size = 16;
  o.layout.kv_dtype = DType::kBf16;
  o.layout.num_pages = 96;
  o.max_decode_batch = 2;                 // a 3-entry decode runs as 2 + 1
  o.staging_bytes = int64_t{90112} * 48;  // 48 tokens of 7B-like geometry per prefill chunk
  return o;
}

TEST(CudaEngineOptions, RejectsUnsupportedConfigurations) {
  CudaEngineOptions o = TestOptions();
  o.layout.kv_dtype = DType::kFp32;
  auto e = CreateCudaEngine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(e.status().message()).find("KV dtype fp32"), std::string::npos)
      << e.status();

  o = TestOptions();
  o.geometry.head_dim = o.layout.head_dim = 96;
  e = CreateCudaEngine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(e.status().message()).find("head_dim 96"), std::string::npos) << e.status();
}

TEST(CudaEngineOptions, NoDeviceIsFailedPrecondition) {
  std::string why, detail;
  if (gpu_test::GpuPresent(&why, &detail)) {
    std::fprintf(stderr, "*** a CUDA device is present: checking creation succeeds instead ***\n");
    auto e = CreateCudaEngine(TestOptions());
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ((*e)->backend(), "cuda");
    EXPECT_FALSE((*e)->device_name().empty());
    return;
  }
  auto e = CreateCudaEngine(TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(e.status().message()).find("no usable CUDA device"), std::string::npos)
      << e.status();
}

using engine_testing::ExpectClose;
using engine_testing::RandomTensor;
using engine_testing::Tensor;

TEST(CudaEngine, PrefillAndDecodeMatchReference) {
  REQUIRE_GPU();
  const CudaEngineOptions opts = TestOptions();
  auto created = CreateCudaEngine(opts);
  ASSERT_TRUE(created.ok()) << created.status();
  Engine& engine = **created;
  const DcaGeometry g = opts.geometry;
  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  std::mt19937 rng(7);

  // Three sequences: prompt chunks, dtypes; pages dealt from a shuffled pool.
  struct Seq {
    std::vector<int64_t> chunks;
    DType in, out;
    std::vector<int32_t> pages;
    int64_t length = 0;
  };
  std::vector<Seq> seqs = {{{300}, DType::kBf16, DType::kFp32},          // > 4 chunks of 64
                           {{1}, DType::kFp32, DType::kBf16},            // one token
                           {{100, 29, 3}, DType::kFp16, DType::kFp16}};  // chunked, page edges
  std::vector<int32_t> perm(opts.layout.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  size_t next = 0;
  for (Seq& s : seqs) {
    const int64_t prompt = std::accumulate(s.chunks.begin(), s.chunks.end(), int64_t{0});
    const int64_t pages = (prompt + 3 + opts.layout.page_size - 1) / opts.layout.page_size;
    s.pages.assign(perm.begin() + next, perm.begin() + next + pages);
    next += pages;
  }
  std::vector<naive::NaiveSequence> refs;
  for (size_t i = 0; i < seqs.size(); ++i) refs.emplace_back(g, opts.layout.num_layers);

  for (int layer = 0; layer < 2; ++layer) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      const int64_t prompt = std::accumulate(s.chunks.begin(), s.chunks.end(), int64_t{0});
      int64_t start = 0;
      for (int64_t t : s.chunks) {
        const Tensor q = RandomTensor({t, kNumQueryVariants, hq, d}, s.in, &rng);
        const Tensor k = RandomTensor({t, hkv, d}, s.in, &rng);
        const Tensor v = RandomTensor({t, hkv, d}, s.in, &rng);
        std::vector<uint8_t> out(t * hq * d * ElementSize(s.out), 0xff);  // poisoned
        PrefillJob job = EngineJobsForTesting::Prefill();
        job.layer = layer;
        job.page_table = s.pages.data();
        job.num_pages = static_cast<int64_t>(s.pages.size());
        job.start = start;
        job.num_tokens = t;
        job.prompt_len = prompt;
        job.q = q.view();
        job.k = k.view();
        job.v = v.view();
        job.out = out.data();
        job.out_dtype = s.out;
        const absl::Status st = engine.Prefill(job);
        ASSERT_TRUE(st.ok()) << st;
        auto want = refs[i].Prefill(layer, q.values, k.values, v.values, prompt);
        ASSERT_TRUE(want.ok()) << want.status();
        ExpectClose(out, s.out, *want,
                    "prefill seq" + std::to_string(i) + " layer" + std::to_string(layer) + " [" +
                        std::to_string(start) + "," + std::to_string(start + t) + ")");
        start += t;
      }
      s.length = start;
    }
  }

  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      DecodeJob job = EngineJobsForTesting::Decode();
      job.layer = layer;
      std::vector<Tensor> qs, ks, vs;
      std::vector<std::vector<uint8_t>> outs;
      for (Seq& s : seqs) {
        // q carries all 5 variants on even steps, only 3 on odd ones.
        qs.push_back(RandomTensor({step % 2 ? 3 : 5, hq, d}, s.in, &rng));
        ks.push_back(RandomTensor({hkv, d}, s.in, &rng));
        vs.push_back(RandomTensor({hkv, d}, s.in, &rng));
        outs.emplace_back(hq * d * ElementSize(s.out), 0xff);
      }
      for (size_t i = 0; i < seqs.size(); ++i) {
        DecodeJob::Entry e;
        e.page_table = seqs[i].pages.data();
        e.num_pages = static_cast<int64_t>(seqs[i].pages.size());
        e.length = seqs[i].length + step + 1;
        e.q = qs[i].view();
        e.k = ks[i].view();
        e.v = vs[i].view();
        e.out = outs[i].data();
        e.out_dtype = seqs[i].out;
        job.entries.push_back(e);
      }
      const absl::Status st = engine.Decode(job).status();
      ASSERT_TRUE(st.ok()) << st;
      for (size_t i = 0; i < seqs.size(); ++i) {
        auto want = refs[i].Decode(layer, qs[i].values, ks[i].values, vs[i].values);
        ASSERT_TRUE(want.ok()) << want.status();
        ExpectClose(outs[i], seqs[i].out, *want,
                    "decode seq" + std::to_string(i) + " layer" + std::to_string(layer) +
                        " L=" + std::to_string(job.entries[i].length));
      }
    }
  }
}

// The serving path's CUDA graphs: an engine that replays a captured graph per batch size (padding
// to the next captured size with length-0 rows) and one that launches the same step eagerly
// (--disable-cuda-graphs) must produce bit-identical outputs for the same inputs, both close to the
// fp64 reference. Padded batches (3 -> 4, 13 -> 16) must leave every other sequence's KV intact:
// later steps over all sequences are checked against the reference too.
TEST(CudaEngine, GraphReplayIsBitIdenticalToEagerLaunch) {
  REQUIRE_GPU();
  CudaEngineOptions with_graphs = TestOptions();
  with_graphs.layout.num_pages = 640;
  with_graphs.max_decode_batch = 16;
  with_graphs.graph_batch_sizes = {1, 2, 4, 8, 16, 32};  // 32 > max: dropped
  CudaEngineOptions eager = with_graphs;
  eager.cuda_graphs = false;
  auto a = CreateCudaEngine(with_graphs);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = CreateCudaEngine(eager);
  ASSERT_TRUE(b.ok()) << b.status();
  const DcaGeometry g = with_graphs.geometry;
  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  const int32_t page = with_graphs.layout.page_size;
  std::mt19937 rng(11);

  // 16 sequences, prompts from 1 token to > 4 DCA chunks, several on page edges.
  const std::vector<int64_t> prompts = {1,  15,  16,  17,  31,  32,  63,  64,
                                        65, 100, 128, 129, 200, 255, 256, 301};
  const int n_seq = static_cast<int>(prompts.size());
  std::vector<int32_t> perm(with_graphs.layout.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> pages(n_seq);
  std::vector<int64_t> lengths(n_seq);
  std::vector<naive::NaiveSequence> refs;
  size_t next = 0;
  for (int i = 0; i < n_seq; ++i) {
    const int64_t n_pages = (prompts[i] + 8 + page - 1) / page;  // room for the decode steps
    pages[i].assign(perm.begin() + next, perm.begin() + next + n_pages);
    next += n_pages;
    refs.emplace_back(g, with_graphs.layout.num_layers);
  }
  ASSERT_LE(next, perm.size());
  for (int layer = 0; layer < 2; ++layer) {
    for (int i = 0; i < n_seq; ++i) {
      const int64_t t = prompts[i];
      const Tensor q = RandomTensor({t, kNumQueryVariants, hq, d}, DType::kBf16, &rng);
      const Tensor k = RandomTensor({t, hkv, d}, DType::kBf16, &rng);
      const Tensor v = RandomTensor({t, hkv, d}, DType::kBf16, &rng);
      std::vector<uint8_t> out(t * hq * d * 4);
      PrefillJob job = EngineJobsForTesting::Prefill();
      job.layer = layer;
      job.page_table = pages[i].data();
      job.num_pages = static_cast<int64_t>(pages[i].size());
      job.num_tokens = t;
      job.prompt_len = t;
      job.q = q.view();
      job.k = k.view();
      job.v = v.view();
      job.out = out.data();
      ASSERT_TRUE((*a)->Prefill(job).ok());
      ASSERT_TRUE((*b)->Prefill(job).ok());
      ASSERT_TRUE(refs[i].Prefill(layer, q.values, k.values, v.values, t).ok());
      lengths[i] = t;
    }
  }

  // Batch sizes: captured (1, 8, 16) and padded (3 -> 4, 13 -> 16); then all 16 again.
  const std::vector<int> batches = {1, 3, 8, 13, 16, 16};
  int first = 0;
  for (size_t step = 0; step < batches.size(); ++step) {
    const int n = batches[step];
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<Tensor> qs, ks, vs;
      std::vector<std::vector<uint8_t>> out_a, out_b;
      DecodeJob job_a = EngineJobsForTesting::Decode(), job_b = EngineJobsForTesting::Decode();
      job_a.layer = job_b.layer = layer;
      std::vector<int> which;
      for (int j = 0; j < n; ++j) which.push_back((first + j) % n_seq);
      // Rows in different dtypes within one batch: a replayed graph reads each row's from memory.
      const DType kInputs[] = {DType::kBf16, DType::kFp32, DType::kFp16};
      for (size_t j = 0; j < which.size(); ++j) {
        const DType in = kInputs[(first + j) % 3];
        qs.push_back(RandomTensor({3, hq, d}, in, &rng));
        ks.push_back(RandomTensor({hkv, d}, in, &rng));
        vs.push_back(RandomTensor({hkv, d}, kInputs[(first + j + 1) % 3], &rng));
        out_a.emplace_back(hq * d * 4, 0xff);  // poisoned, differently in the two
        out_b.emplace_back(hq * d * 4, 0x7f);
      }
      for (int j = 0; j < n; ++j) {
        const int i = which[j];
        DecodeJob::Entry e;
        e.page_table = pages[i].data();
        e.num_pages = static_cast<int64_t>(pages[i].size());
        e.length = lengths[i] + 1;
        e.q = qs[j].view();
        e.k = ks[j].view();
        e.v = vs[j].view();
        e.out = out_a[j].data();
        job_a.entries.push_back(e);
        e.out = out_b[j].data();
        job_b.entries.push_back(e);
      }
      absl::StatusOr<DecodeStats> ran_a = (*a)->Decode(job_a);
      absl::StatusOr<DecodeStats> ran_b = (*b)->Decode(job_b);
      ASSERT_TRUE(ran_a.ok()) << ran_a.status();
      ASSERT_TRUE(ran_b.ok()) << ran_b.status();
      EXPECT_EQ(ran_a->graph_replays, 1) << "batch " << n << ": the graph engine did not replay";
      EXPECT_EQ(ran_b->graph_replays, 0) << "batch " << n << ": the eager engine replayed";
      EXPECT_EQ(ran_b->eager_launches, 1);
      // Both plan the batch as the next captured size: the same padding rows.
      EXPECT_EQ(ran_a->padding_entries, ran_b->padding_entries);
      for (int j = 0; j < n; ++j) {
        EXPECT_EQ(std::memcmp(out_a[j].data(), out_b[j].data(), out_a[j].size()), 0)
            << "batch " << n << " layer " << layer << " entry " << j
            << ": graph replay differs from the eager launch";
        auto want = refs[which[j]].Decode(layer, qs[j].values, ks[j].values, vs[j].values);
        ASSERT_TRUE(want.ok()) << want.status();
        ExpectClose(out_a[j], DType::kFp32, *want,
                    "graph batch " + std::to_string(n) + " layer " + std::to_string(layer) +
                        " seq " + std::to_string(which[j]));
      }
    }
    for (int j = 0; j < n; ++j) ++lengths[(first + j) % n_seq];
    first = (first + n) % n_seq;
  }
}

// Device memory for a test's "region" tensors (what a CUDA IPC region maps to).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&p_, bytes) != cudaSuccess) p_ = nullptr;
    if (p_ != nullptr) cudaMemset(p_, 0xff, bytes);  // poisoned: an unwritten output shows
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* get() const { return static_cast<char*>(p_); }

 private:
  void* p_ = nullptr;
};

// Decode with q/k/v and outputs in device memory (CUDA IPC region tensors) must equal the same
// decode from host memory bit for bit: two engines with the same KV, one fed host tensors, one
// device tensors (every row, or a mix of host rows, device rows and rows with some of each),
// through captured graphs (4, 3 -> 4) and eager launches (12 > the largest size, 8). Rows mix
// kVariants and kPreRotary queries, bf16/fp16/fp32 inputs and outputs, q with a row pitch and
// device addresses that are not 16-byte aligned (only element aligned). The device engine's
// outputs are also checked against the fp64 reference. Pre-rotary rows rotate rotary_dim dims.
void CheckDeviceRowsMatchHostRows(int32_t rotary_dim) {
  CudaEngineOptions opts = TestOptions();
  opts.geometry.chunk_size = opts.geometry.chunk_len + 16;
  opts.geometry.rope_theta = 10000.0;
  opts.geometry.rotary_dim = rotary_dim;
  opts.layout.num_pages = 640;
  opts.max_decode_batch = 16;
  opts.graph_batch_sizes = {1, 2, 4, 8};
  auto host_engine = CreateCudaEngine(opts);
  ASSERT_TRUE(host_engine.ok()) << host_engine.status();
  auto device_engine = CreateCudaEngine(opts);
  ASSERT_TRUE(device_engine.ok()) << device_engine.status();
  Engine& a = **host_engine;
  Engine& b = **device_engine;
  const DcaGeometry g = opts.geometry;
  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  const int32_t page = opts.layout.page_size;
  std::mt19937 rng(23);

  const std::vector<int64_t> prompts = {1, 16, 17, 63, 64, 65, 100, 129, 200, 256, 301, 40};
  const int n_seq = static_cast<int>(prompts.size());
  std::vector<int32_t> perm(opts.layout.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> pages(n_seq);
  std::vector<int64_t> lengths(n_seq);
  std::vector<naive::NaiveSequence> refs;
  size_t next = 0;
  for (int i = 0; i < n_seq; ++i) {
    const int64_t n_pages = (prompts[i] + 8 + page - 1) / page;
    pages[i].assign(perm.begin() + next, perm.begin() + next + n_pages);
    next += n_pages;
    refs.emplace_back(g, opts.layout.num_layers);
  }
  ASSERT_LE(next, perm.size());
  for (int layer = 0; layer < 2; ++layer) {
    for (int i = 0; i < n_seq; ++i) {
      const int64_t t = prompts[i];
      const Tensor q = RandomTensor({t, kNumQueryVariants, hq, d}, DType::kBf16, &rng);
      const Tensor k = RandomTensor({t, hkv, d}, DType::kBf16, &rng);
      const Tensor v = RandomTensor({t, hkv, d}, DType::kBf16, &rng);
      std::vector<uint8_t> out(t * hq * d * 4);
      PrefillJob job = EngineJobsForTesting::Prefill();
      job.layer = layer;
      job.page_table = pages[i].data();
      job.num_pages = static_cast<int64_t>(pages[i].size());
      job.num_tokens = t;
      job.prompt_len = t;
      job.q = q.view();
      job.k = k.view();
      job.v = v.view();
      job.out = out.data();
      ASSERT_TRUE(a.Prefill(job).ok());
      ASSERT_TRUE(b.Prefill(job).ok());
      ASSERT_TRUE(refs[i].Prefill(layer, q.values, k.values, v.values, t).ok());
      lengths[i] = t;
    }
  }

  // Where a row's tensors live in the device engine's job.
  struct Placement {
    bool q, k, v, out;
  };
  const auto placement = [](bool all_device, int j) -> Placement {
    if (all_device) return {true, true, true, true};
    switch (j % 4) {
      case 0:
        return {false, false, false, false};  // a host row
      case 1:
        return {true, true, true, true};  // a device row
      case 2:
        return {true, false, false, false};  // device q, the rest on the host
      default:
        return {false, true, true, true};  // device k, v and output
    }
  };
  struct Step {
    int n;
    bool all_device;
    bool split;  // through StartDecode / Finish
  };
  // 4: a captured size; 3: padded to 4; 12: eager (larger than every captured size).
  const std::vector<Step> steps = {
      {4, true, false}, {3, false, true}, {12, true, false}, {12, false, false}, {4, false, true}};
  const DType kDtypes[] = {DType::kBf16, DType::kFp32, DType::kFp16};
  int first = 0;
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& step = steps[si];
    for (int layer = 0; layer < 2; ++layer) {
      const int n = step.n;
      std::vector<Tensor> qs, ks, vs;
      std::vector<std::vector<uint8_t>> out_a, out_b;
      std::vector<int> which;
      std::vector<bool> pre_rotary;
      for (int j = 0; j < n; ++j) {
        which.push_back((first + j) % n_seq);
        const DType in = kDtypes[(si + j) % 3];
        const DType out = kDtypes[(si + j + 1) % 3];
        pre_rotary.push_back(j % 4 == 3 || (j % 5 == 1));
        // kVariants q carries 5 variants on even rows, 3 on odd ones.
        qs.push_back(pre_rotary[j] ? RandomTensor({hq, d}, in, &rng)
                                   : RandomTensor({j % 2 ? 3 : 5, hq, d}, in, &rng));
        ks.push_back(RandomTensor({hkv, d}, in, &rng));
        vs.push_back(RandomTensor({hkv, d}, kDtypes[(si + j + 2) % 3], &rng));
        out_a.emplace_back(hq * d * ElementSize(out), 0xff);
        out_b.emplace_back(hq * d * ElementSize(out), 0x7f);
      }
      // The device engine's region: each tensor at its own offset, not 16-byte aligned on odd
      // rows; q of even rows with a row pitch that is not a multiple of 16 either.
      const size_t slot = 4 * (5 * hq * d * 4 + 512);  // a row's q, k, v and out, with slack
      DeviceBuffer region(slot * n);
      ASSERT_NE(region.get(), nullptr);
      DecodeJob job_a = EngineJobsForTesting::Decode(), job_b = EngineJobsForTesting::Decode();
      job_a.layer = job_b.layer = layer;
      for (int j = 0; j < n; ++j) {
        const int i = which[j];
        const DType out_dtype = kDtypes[(si + j + 1) % 3];
        DecodeJob::Entry e;
        e.page_table = pages[i].data();
        e.num_pages = static_cast<int64_t>(pages[i].size());
        e.length = lengths[i] + 1;
        e.q_layout = pre_rotary[j] ? QLayout::kPreRotary : QLayout::kVariants;
        e.q = qs[j].view();
        e.k = ks[j].view();
        e.v = vs[j].view();
        e.out = out_a[j].data();
        e.out_dtype = out_dtype;
        job_a.entries.push_back(e);

        const Placement at = placement(step.all_device, j);
        char* base = region.get() + j * slot;
        const size_t skew = j % 2 ? 2 * ElementSize(qs[j].dtype) : 0;
        const auto to_device = [&](const Tensor& t, size_t offset, int64_t pitch) {
          TensorView view = t.view();
          char* dst = base + offset + skew;
          const int64_t row = RowBytes(view), rows = NumRows(view);
          EXPECT_EQ(cudaMemcpy2D(dst, pitch != 0 ? pitch : row, t.bytes.data(), row, row, rows,
                                 cudaMemcpyHostToDevice),
                    cudaSuccess);
          view.data = dst;
          view.on_device = true;
          view.row_pitch = pitch;
          return view;
        };
        const int64_t q_row = RowBytes(qs[j].view());
        const int64_t q_pitch =
            !pre_rotary[j] && j % 2 == 0 ? q_row + 6 * ElementSize(qs[j].dtype) : 0;
        if (at.q) e.q = to_device(qs[j], 0, q_pitch);
        if (at.k) e.k = to_device(ks[j], 5 * hq * d * 4 + 256, 0);
        if (at.v) e.v = to_device(vs[j], 6 * hq * d * 4, 0);
        if (at.out) {
          e.out = base + 7 * hq * d * 4 + skew;
          e.out_on_device = true;
        } else {
          e.out = out_b[j].data();
        }
        job_b.entries.push_back(e);
      }
      absl::StatusOr<DecodeStats> ran_a = a.Decode(job_a);
      ASSERT_TRUE(ran_a.ok()) << ran_a.status();
      absl::StatusOr<DecodeStats> ran_b;
      if (step.split) {
        absl::StatusOr<std::unique_ptr<PendingDecode>> started = b.StartDecode(job_b);
        ASSERT_TRUE(started.ok()) << started.status();
        ASSERT_NE(*started, nullptr) << "a batch with device rows did not start as a split launch";
        ran_b = (*started)->Finish();
      } else {
        ran_b = b.Decode(job_b);
      }
      ASSERT_TRUE(ran_b.ok()) << ran_b.status();
      EXPECT_EQ(ran_a->graph_replays, ran_b->graph_replays);
      EXPECT_EQ(ran_a->eager_launches, ran_b->eager_launches);
      EXPECT_EQ(ran_b->graph_replays, n <= 8 ? 1 : 0) << "batch " << n;
      for (int j = 0; j < n; ++j) {
        const DecodeJob::Entry& e = job_b.entries[j];
        if (e.out_on_device) {
          ASSERT_EQ(cudaMemcpy(out_b[j].data(), e.out, out_b[j].size(), cudaMemcpyDeviceToHost),
                    cudaSuccess);
        }
        const std::string what =
            "step " + std::to_string(si) + " layer " + std::to_string(layer) + " row " +
            std::to_string(j) + (pre_rotary[j] ? " pre-rotary" : "") +
            (e.out_on_device ? " device out " : " host out ") + std::string(DTypeName(e.out_dtype));
        EXPECT_EQ(std::memcmp(out_a[j].data(), out_b[j].data(), out_a[j].size()), 0)
            << what << ": the device tensors' output differs from the host tensors'";
        auto want =
            pre_rotary[j]
                ? refs[which[j]].DecodePreRotary(layer, qs[j].values, ks[j].values, vs[j].values)
                : refs[which[j]].Decode(layer, qs[j].values, ks[j].values, vs[j].values);
        ASSERT_TRUE(want.ok()) << want.status();
        ExpectClose(out_b[j], e.out_dtype, *want, what);
      }
    }
    for (int j = 0; j < step.n; ++j) ++lengths[(first + j) % n_seq];
    first = (first + step.n) % n_seq;
  }

  // A device tensor that is not aligned to its elements is refused before anything runs.
  DeviceBuffer region(1 << 20);
  ASSERT_NE(region.get(), nullptr);
  const Tensor q = RandomTensor({3, hq, d}, DType::kFp32, &rng);
  const Tensor k = RandomTensor({hkv, d}, DType::kFp32, &rng);
  std::vector<float> out(hq * d);
  DecodeJob job = EngineJobsForTesting::Decode();
  DecodeJob::Entry e;
  e.page_table = pages[0].data();
  e.num_pages = static_cast<int64_t>(pages[0].size());
  e.length = lengths[0] + 1;
  e.q = q.view();
  e.k = k.view();
  e.v = k.view();
  e.k.data = region.get() + 2;  // fp32 at a 2-byte offset
  e.k.on_device = true;
  e.out = out.data();
  job.entries.push_back(e);
  const absl::Status st = b.Decode(job).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("device tensor k (fp32, row pitch 0) is not aligned"),
            std::string::npos)
      << st;
}

TEST(CudaEngine, DeviceRowsMatchHostRowsBitForBit) {
  REQUIRE_GPU();
  CheckDeviceRowsMatchHostRows(128);
}

// The same with a partial rotary (dims past rotary_dim are copied, not rotated).
TEST(CudaEngine, DeviceRowsMatchHostRowsBitForBitPartialRotary) {
  REQUIRE_GPU();
  CheckDeviceRowsMatchHostRows(96);
}

// A prefill cut into steps of one key tile per window (and staging chunks of 48 tokens) writes the
// same output and K/V bit for bit as the same call in whole launches; a run dropped half-way leaves
// the engine to run the next call exactly; and decode steps run while a run is open.
TEST(CudaEngine, SteppedPrefillIsBitIdenticalToWholeLaunches) {
  REQUIRE_GPU();
  CudaEngineOptions stepped = TestOptions();
  stepped.prefill_step_keys = 1;  // one key tile per window
  CudaEngineOptions whole = TestOptions();
  whole.prefill_step_keys = int64_t{1} << 40;
  auto a = CreateCudaEngine(stepped);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = CreateCudaEngine(whole);
  ASSERT_TRUE(b.ok()) << b.status();
  const DcaGeometry g = stepped.geometry;
  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  std::mt19937 rng(5);
  std::vector<int32_t> pages(24), other(8);
  std::iota(pages.begin(), pages.end(), 40);  // 384 tokens
  std::iota(other.begin(), other.end(), 10);
  // Calls of 301 tokens (five DCA chunks of 64, seven staging chunks), then 50 more from 301.
  int64_t start = 0;
  for (const int64_t t : {int64_t{301}, int64_t{50}}) {
    const Tensor q = RandomTensor({t, kNumQueryVariants, hq, d}, DType::kBf16, &rng);
    const Tensor k = RandomTensor({t, hkv, d}, DType::kBf16, &rng);
    const Tensor v = RandomTensor({t, hkv, d}, DType::kBf16, &rng);
    std::vector<uint8_t> out_a(t * hq * d * 4, 0xff), out_b(t * hq * d * 4, 0x7f);
    PrefillJob job = EngineJobsForTesting::Prefill();
    job.layer = 1;
    job.page_table = pages.data();
    job.num_pages = static_cast<int64_t>(pages.size());
    job.start = start;
    job.num_tokens = t;
    job.prompt_len = 351;
    job.q = q.view();
    job.k = k.view();
    job.v = v.view();
    // A run of the same job dropped after three steps first: what it wrote lies past the layer's
    // length, and the full run below overwrites it.
    {
      job.out = out_a.data();
      auto dropped = (*a)->StartPrefill(job);
      ASSERT_TRUE(dropped.ok()) << dropped.status();
      for (int i = 0; i < 3 && !(*dropped)->done(); ++i) ASSERT_TRUE((*dropped)->Step().ok());
    }
    auto run = (*a)->StartPrefill(job);
    ASSERT_TRUE(run.ok()) << run.status();
    int steps = 0;
    while (!(*run)->done()) {
      ASSERT_TRUE((*run)->Step().ok());
      ++steps;
    }
    run->reset();
    job.out = out_b.data();
    ASSERT_TRUE((*b)->Prefill(job).ok());
    EXPECT_GT(steps, (t + 47) / 48) << "windows cut the chunks";
    EXPECT_EQ(out_a, out_b) << "prefill of " << t << " tokens from " << start;
    start += t;
  }
  // The K/V the two wrote: a decode reads all of it, beside an open run on another sequence.
  const Tensor q = RandomTensor({3, hq, d}, DType::kBf16, &rng);
  const Tensor k = RandomTensor({hkv, d}, DType::kBf16, &rng);
  const Tensor v = RandomTensor({hkv, d}, DType::kBf16, &rng);
  const Tensor pq = RandomTensor({100, kNumQueryVariants, hq, d}, DType::kBf16, &rng);
  const Tensor pk = RandomTensor({100, hkv, d}, DType::kBf16, &rng);
  std::vector<uint8_t> pout(100 * hq * d * 4);
  PrefillJob open = EngineJobsForTesting::Prefill();
  open.layer = 1;
  open.page_table = other.data();
  open.num_pages = static_cast<int64_t>(other.size());
  open.num_tokens = 100;
  open.prompt_len = 100;
  open.q = pq.view();
  open.k = open.v = pk.view();
  open.out = pout.data();
  auto open_run = (*a)->StartPrefill(open);
  ASSERT_TRUE(open_run.ok());
  ASSERT_TRUE((*open_run)->Step().ok());
  std::vector<uint8_t> dec_a(hq * d * 4), dec_b(hq * d * 4);
  for (auto* engine : {&*a, &*b}) {
    DecodeJob job = EngineJobsForTesting::Decode();
    job.layer = 1;
    DecodeJob::Entry e;
    e.page_table = pages.data();
    e.num_pages = static_cast<int64_t>(pages.size());
    e.length = start + 1;
    e.q = q.view();
    e.k = k.view();
    e.v = v.view();
    e.out = (engine == &*a ? dec_a : dec_b).data();
    job.entries.push_back(e);
    ASSERT_TRUE((*engine)->Decode(job).ok());
  }
  EXPECT_EQ(dec_a, dec_b);
  while (!(*open_run)->done()) ASSERT_TRUE((*open_run)->Step().ok());
}

TEST(CudaEngine, RejectsBadPagesAndShapes) {
  REQUIRE_GPU();
  auto created = CreateCudaEngine(TestOptions());
  ASSERT_TRUE(created.ok()) << created.status();
  Engine& engine = **created;
  std::mt19937 rng(3);
  const Tensor q = RandomTensor({4, kNumQueryVariants, 28, 128}, DType::kBf16, &rng);
  const Tensor k = RandomTensor({4, 4, 128}, DType::kBf16, &rng);
  std::vector<float> out(4 * 28 * 128);
  std::vector<int32_t> pages = {5, 1000};
  PrefillJob job = EngineJobsForTesting::Prefill();
  job.page_table = pages.data();
  job.num_pages = 2;
  job.num_tokens = 4;
  job.prompt_len = 4;
  job.q = q.view();
  job.k = k.view();
  job.v = k.view();
  job.out = out.data();
  absl::Status st = engine.Prefill(job);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("page id 1000"), std::string::npos) << st;
  pages[1] = 6;
  job.layer = 2;
  st = engine.Prefill(job);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("layer 2"), std::string::npos) << st;
  job.layer = 0;
  job.k.shape = {3, 4, 128};
  st = engine.Prefill(job);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("k has"), std::string::npos) << st;
  job.k.shape = {4, 4, 128};
  EXPECT_TRUE(engine.Prefill(job).ok());
}

}  // namespace
}  // namespace attnd
