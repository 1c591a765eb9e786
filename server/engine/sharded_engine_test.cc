// Sharded engines against the unsharded one: two and four shards over the kv heads, for dense,
// sparse and pre-rotary prefill and batched decode. On the CPU the outputs must be bit-identical
// (every head's attention is computed by the same kernel on the same data, only by another
// engine). sharded_engine_cuda_test (ATTND_SHARDED_ON_CUDA) runs the comparisons on one GPU with
// the shards on the same device (--devices 0,0 / 0,0,0,0), CUDA graphs on: prefill must still be
// identical, decode within 1e-3 (each shard plans its split-K for its own head count, so the
// reduction order differs). A shard that fails fails the job, naming the shard, and the runtime
// rolls the pages back once for all shards.
#include "server/engine/sharded_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kvcache/kv_layout.h"
#include "server/config/sparse_config.h"
#include "server/config/test_models.h"
#include "server/engine/cpu_engine.h"
#include "server/engine/cuda_engine.h"
#include "server/engine/engine.h"
#include "server/engine/engine_factory.h"
#include "server/engine/engine_jobs_for_testing.h"
#include "server/engine/fault_engine.h"
#include "server/runtime/runtime.h"

#ifdef ATTND_SHARDED_ON_CUDA
constexpr bool kOnCuda = true;
#else
constexpr bool kOnCuda = false;
#endif

namespace attnd {
namespace {

constexpr int32_t kLayers = 2, kHq = 8, kHkv = 4, kD = 64, kPageSize = 16, kPages = 64;

// The tiny model (chunk_len 128, a rotary over all 64 dims) with twice its heads.
DcaGeometry Geometry() {
  DcaGeometry g = test_models::TinyModel().geometry();
  g.num_q_heads = kHq;
  g.num_kv_heads = kHkv;
  return g;
}

std::shared_ptr<const SparseAttentionConfig> Sparse() {
  auto sp = std::make_shared<SparseAttentionConfig>();
  sp->source = "test";
  sp->num_layers = kLayers;
  sp->num_q_heads = kHq;
  sp->enabled = true;
  sp->threshold = 200;
  sp->last_q = 32;
  for (int32_t i = 0; i < kLayers * kHq; ++i) {
    sp->budgets.push_back({20 + 15 * (i % 5), 40 + 30 * (i % 3)});
  }
  return sp;
}

std::unique_ptr<Engine> Make(int32_t shards, std::shared_ptr<const SparseAttentionConfig> sparse,
                             DType kv_dtype = DType::kFp32) {
  EngineOptions o;
  o.device = "cpu";
  o.shards = shards;
  if (kOnCuda) {  // K/V in bf16 where the test asks for fp32
    o.device = "cuda";
    o.shards = 0;
    // ATTND_TEST_DEVICES (e.g. "0,1" on a two-GPU machine) used in turn; else every shard on GPU 0.
    const char* env = std::getenv("ATTND_TEST_DEVICES");
    absl::StatusOr<std::vector<int32_t>> listed =
        ParseDeviceList(env != nullptr && *env != '\0' ? env : "0");
    EXPECT_TRUE(listed.ok()) << listed.status();
    if (!listed.ok() || listed->empty()) return nullptr;
    for (int32_t i = 0; i < shards; ++i) o.devices.push_back((*listed)[i % listed->size()]);
    if (kv_dtype == DType::kFp32) kv_dtype = DType::kBf16;
  }
  o.geometry = Geometry();
  o.num_layers = kLayers;
  o.page_size = kPageSize;
  o.kv_dtype = kv_dtype == DType::kFp32      ? "fp32"
               : kv_dtype == DType::kInt8    ? "int8"
               : kv_dtype == DType::kFp8E4m3 ? "fp8"
                                             : "bf16";
  o.kv_cache_bytes = kPages * KvLayout{kLayers, kHkv, kD, kPageSize, kv_dtype, 1}.bytes_per_page();
  o.compute_threads = 2;
  o.sparse = std::move(sparse);
  absl::StatusOr<std::unique_ptr<Engine>> e = CreateEngine(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

struct Tensor {
  DType dtype = DType::kFp32;
  std::vector<int64_t> shape;
  std::string bytes;
  TensorView view() const {
    TensorView v;
    v.dtype = dtype;
    v.data = bytes.data();
    v.shape = shape;
    return v;
  }
};

Tensor Random(std::vector<int64_t> shape, std::mt19937* rng, DType dtype = DType::kFp32) {
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> raw(n);
  for (float& x : raw) x = dist(*rng);
  Tensor t{dtype, std::move(shape), std::string(n * ElementSize(dtype), '\0')};
  ConvertFromFloat(raw.data(), n, dtype, t.bytes.data());
  return t;
}

// The same calls on several engines: the pages of one sequence (a scattered table) and the
// layers' lengths.
class Sequences {
 public:
  explicit Sequences(std::vector<Engine*> engines) : engines_(std::move(engines)) {}

  // Prefill t tokens at `start` of `layer` on every engine; returns each engine's output bytes.
  std::vector<std::string> Prefill(int32_t layer, int64_t start, int64_t t, QLayout q_layout,
                                   DType out_dtype, std::mt19937* rng, bool expect_ok = true) {
    const Tensor q = Random(q_layout == QLayout::kPreRotary
                                ? std::vector<int64_t>{t, kHq, kD}
                                : std::vector<int64_t>{t, kNumQueryVariants, kHq, kD},
                            rng, DType::kBf16);
    const Tensor k = Random({t, kHkv, kD}, rng, DType::kBf16);
    const Tensor v = Random({t, kHkv, kD}, rng, DType::kBf16);  // CUDA: one dtype for pre-rotary
    std::vector<std::string> outs;
    for (Engine* e : engines_) {
      PrefillJob job = EngineJobsForTesting::Prefill();
      job.layer = layer;
      job.page_table = table_.data();
      job.num_pages = static_cast<int64_t>(table_.size());
      job.start = start;
      job.num_tokens = t;
      job.prompt_len = start + t;
      job.q_layout = q_layout;
      job.q = q.view();
      job.k = k.view();
      job.v = v.view();
      std::string& out = outs.emplace_back(t * kHq * kD * ElementSize(out_dtype), '\0');
      job.out = out.data();
      job.out_dtype = out_dtype;
      last_status_ = e->Prefill(job);
      if (expect_ok) {
        EXPECT_TRUE(last_status_.ok()) << e->device() << ": " << last_status_;
      }
    }
    return outs;
  }

  std::vector<int32_t> table_ = {7,  3,  60, 12, 0,  33, 21, 5,  48, 9,  40, 17, 2,
                                 55, 26, 11, 63, 30, 1,  44, 19, 8,  37, 50, 14};  // 400 tokens
  absl::Status last_status_;

 private:
  std::vector<Engine*> engines_;
};

// Every engine's output equals the first's: bitwise, or within `tolerance` (fp32 outputs).
void ExpectSame(const std::vector<std::string>& outs, const std::string& what,
                double tolerance = 0) {
  for (size_t i = 1; i < outs.size(); ++i) {
    ASSERT_EQ(outs[i].size(), outs[0].size()) << what;
    if (tolerance == 0) {
      EXPECT_TRUE(outs[i] == outs[0]) << what << ": engine " << i << " differs from unsharded";
      continue;
    }
    const float* a = reinterpret_cast<const float*>(outs[0].data());
    const float* b = reinterpret_cast<const float*>(outs[i].data());
    double worst = 0;
    for (size_t j = 0; j < outs[0].size() / 4; ++j)
      worst = std::max<double>(worst, std::abs(a[j] - b[j]));
    EXPECT_LE(worst, tolerance) << what << ": engine " << i << " vs unsharded";
  }
}

// The GPU comparisons skip (loudly) where there is no GPU.
#define SKIP_WITHOUT_DEVICE()                                                                \
  do {                                                                                       \
    if (kOnCuda && CudaDeviceCount() == 0) {                                                 \
      std::fprintf(stderr,                                                                   \
                   "*** SKIPPING GPU TEST: sharded_engine_cuda_test: no CUDA device ***\n"); \
      GTEST_SKIP() << "no CUDA device";                                                      \
    }                                                                                        \
  } while (0)

#ifndef ATTND_SHARDED_ON_CUDA

TEST(ShardGeometryTest, SplitsHeadsEvenlyOrSaysWhy) {
  absl::StatusOr<DcaGeometry> two = ShardGeometry(Geometry(), 2);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->num_kv_heads, 2);
  EXPECT_EQ(two->num_q_heads, 4);
  absl::StatusOr<DcaGeometry> three = ShardGeometry(Geometry(), 3);
  ASSERT_FALSE(three.ok());
  EXPECT_EQ(three.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(three.status().message(),
            "3 shards cannot split the model's 4 kv heads evenly: use a number of devices (or "
            "EngineOptions::shards) that divides 4");
}

TEST(ShardSparseTest, TakesEachLayersHeadsOfTheShard) {
  const auto full = Sparse();
  const auto shard = ShardSparse(*full, 4, 4);
  ASSERT_EQ(shard->num_q_heads, 4);
  ASSERT_EQ(shard->budgets.size(), static_cast<size_t>(kLayers * 4));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    for (int32_t h = 0; h < 4; ++h) {
      EXPECT_EQ(shard->layer(layer)[h].vertical, full->layer(layer)[4 + h].vertical);
      EXPECT_EQ(shard->layer(layer)[h].slash, full->layer(layer)[4 + h].slash);
    }
  }
}

TEST(ShardedEngineTest, ReportsShardsAndOnePageCount) {
  std::unique_ptr<Engine> one = Make(1, nullptr), two = Make(2, nullptr), four = Make(4, nullptr);
  ASSERT_TRUE(one && two && four);
  EXPECT_EQ(two->layout().num_pages, one->layout().num_pages);
  EXPECT_EQ(four->layout().num_pages, kPages);
  EXPECT_EQ(four->layout().num_kv_heads, kHkv);
  EXPECT_EQ(four->layout().pool_bytes(), one->layout().pool_bytes());
  EXPECT_EQ(four->device(), "cpu,cpu,cpu,cpu");
  const std::vector<EngineShard> shards = four->shards();
  ASSERT_EQ(shards.size(), 4u);
  for (int32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(shards[i].device, "cpu");
    EXPECT_EQ(shards[i].first_kv_head, i);
    EXPECT_EQ(shards[i].num_kv_heads, 1);
    EXPECT_EQ(shards[i].first_q_head, 2 * i);
    EXPECT_EQ(shards[i].num_q_heads, 2);
    EXPECT_EQ(shards[i].pool_bytes, one->layout().pool_bytes() / 4);
  }
  ASSERT_EQ(one->shards().size(), 1u);
  EXPECT_EQ(one->shards()[0].num_q_heads, kHq);
}

#endif  // !ATTND_SHARDED_ON_CUDA

TEST(ShardedEngineTest, DensePrefillAndDecodeMatchTheUnshardedEngine) {
  SKIP_WITHOUT_DEVICE();
  // One-byte KV too: each shard quantises and scales its own heads' rows, as the whole would.
  for (DType kv :
       kOnCuda ? std::vector<DType>{DType::kBf16, DType::kInt8, DType::kFp8E4m3}
               : std::vector<DType>{DType::kFp32, DType::kBf16, DType::kInt8, DType::kFp8E4m3}) {
    SCOPED_TRACE(DTypeName(kv));
    std::unique_ptr<Engine> one = Make(1, nullptr, kv), two = Make(2, nullptr, kv),
                            four = Make(4, nullptr, kv);
    ASSERT_TRUE(one && two && four);
    Sequences seq({one.get(), two.get(), four.get()});
    std::mt19937 rng(7);
    // Three DCA chunks in one call (chunk_len 128), then a continuation, in both layers, with
    // fp32 and bf16 outputs and pre-rotary queries.
    ExpectSame(seq.Prefill(0, 0, 300, QLayout::kVariants, DType::kFp32, &rng), "prefill 0..300");
    ExpectSame(seq.Prefill(0, 300, 40, QLayout::kPreRotary, DType::kBf16, &rng),
               "pre-rotary prefill 300..340");
    ExpectSame(seq.Prefill(1, 0, 150, QLayout::kPreRotary, DType::kFp32, &rng),
               "pre-rotary prefill layer 1");

    // Two more sequences on pages of their own, then a batch of three decode entries, one per
    // sequence, each appending at its own length.
    Sequences b({one.get(), two.get(), four.get()}), c({one.get(), two.get(), four.get()});
    b.table_ = {41, 42, 43, 45, 46, 47, 49, 51, 52, 53};
    c.table_ = {54, 56, 57, 58, 59, 61, 62};
    ExpectSame(b.Prefill(0, 0, 159, QLayout::kVariants, DType::kFp32, &rng), "prefill b");
    ExpectSame(c.Prefill(0, 0, 96, QLayout::kVariants, DType::kFp32, &rng), "prefill c");
    const int64_t lengths[3] = {341, 160, 97};
    std::vector<Tensor> qs, ks, vs;
    for (int i = 0; i < 3; ++i) {
      const bool pre = i == 1;
      qs.push_back(Random(
          pre ? std::vector<int64_t>{kHq, kD} : std::vector<int64_t>{kNumQueryVariants, kHq, kD},
          &rng));
      ks.push_back(Random({kHkv, kD}, &rng));
      vs.push_back(Random({kHkv, kD}, &rng, DType::kBf16));
    }
    std::vector<std::string> outs;
    for (Engine* e : {one.get(), two.get(), four.get()}) {
      const std::vector<int32_t>* tables[3] = {&seq.table_, &b.table_, &c.table_};
      DecodeJob job = EngineJobsForTesting::Decode();
      job.layer = 0;
      std::string& out = outs.emplace_back(3 * kHq * kD * 4, '\0');
      for (int i = 0; i < 3; ++i) {
        DecodeJob::Entry entry;
        entry.page_table = tables[i]->data();
        entry.num_pages = static_cast<int64_t>(tables[i]->size());
        entry.length = lengths[i];
        entry.q = qs[i].view();
        entry.k = ks[i].view();
        entry.v = vs[i].view();
        entry.q_layout = i == 1 ? QLayout::kPreRotary : QLayout::kVariants;
        entry.out = out.data() + i * kHq * kD * 4;
        job.entries.push_back(entry);
      }
      absl::Status s = e->Decode(job).status();
      ASSERT_TRUE(s.ok()) << e->device() << ": " << s;
    }
    ExpectSame(outs, "batched decode", kOnCuda ? 1e-3 : 0);
  }
}

TEST(ShardedEngineTest, SparsePrefillMatchesTheUnshardedEngine) {
  SKIP_WITHOUT_DEVICE();
  std::unique_ptr<Engine> one = Make(1, Sparse()), two = Make(2, Sparse()),
                          four = Make(4, Sparse());
  ASSERT_TRUE(one && two && four);
  Sequences seq({one.get(), two.get(), four.get()});
  std::mt19937 rng(11);
  // prompt_len 400 > threshold 200: the sparse path, each shard estimating its own heads.
  ExpectSame(seq.Prefill(1, 0, 400, QLayout::kVariants, DType::kFp32, &rng), "sparse prefill");
}

#ifndef ATTND_SHARDED_ON_CUDA

// Two CPU shards of Geometry() over kPages pages, each behind a FaultEngine; *faulty is the
// second one's.
std::unique_ptr<Engine> TwoFaultableShards(FaultEngine** faulty) {
  const absl::StatusOr<DcaGeometry> g = ShardGeometry(Geometry(), 2);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return nullptr;
  std::vector<std::unique_ptr<Engine>> shards;
  for (int i = 0; i < 2; ++i) {
    CpuEngineOptions o;
    o.geometry = *g;
    o.layout = KvLayout{kLayers, g->num_kv_heads, kD, kPageSize, DType::kFp32, kPages};
    o.compute_threads = 1;
    absl::StatusOr<std::unique_ptr<CpuEngine>> e = CpuEngine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    auto f = std::make_unique<FaultEngine>(*std::move(e));
    if (i == 1) *faulty = f.get();
    shards.push_back(std::move(f));
  }
  absl::StatusOr<std::unique_ptr<Engine>> sharded =
      CreateShardedEngine(Geometry(), std::move(shards));
  EXPECT_TRUE(sharded.ok()) << sharded.status();
  return sharded.ok() ? *std::move(sharded) : nullptr;
}

TEST(ShardedEngineTest, AFailingShardFailsTheJobNamingIt) {
  FaultEngine* faulty = nullptr;
  std::unique_ptr<Engine> sharded = TwoFaultableShards(&faulty);
  ASSERT_TRUE(sharded != nullptr);
  Sequences seq({sharded.get()});
  std::mt19937 rng(3);
  faulty->FailNextPrefills(1);
  seq.Prefill(0, 0, 20, QLayout::kVariants, DType::kFp32, &rng, /*expect_ok=*/false);
  EXPECT_EQ(seq.last_status_.code(), absl::StatusCode::kInternal);
  EXPECT_NE(seq.last_status_.message().find("shard 1 (cpu): "), std::string::npos)
      << seq.last_status_;
}

RequestTensor Req(const Tensor& t) { return RequestTensor{t.dtype, t.shape, t.bytes}; }

// Through the runtime: a fault in the second shard fails the call after the first shard has run;
// nothing is committed and no page stays held, in either shard (they share the page table), and
// the sequence goes on to give the unsharded engine's outputs.
TEST(ShardedRuntimeTest, AFaultInOneShardLeavesNoPageHeld) {
  FaultEngine* faulty = nullptr;
  std::unique_ptr<Engine> sharded = TwoFaultableShards(&faulty);
  ASSERT_TRUE(sharded != nullptr);
  ModelConfig model = test_models::TinyModel();
  model.num_q_heads = kHq;
  model.num_kv_heads = kHkv;
  RuntimeOptions ro;
  ro.max_sequence_length = 1024;
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(model, std::move(sharded), ro);
  ASSERT_TRUE(rt.ok()) << rt.status();
  absl::StatusOr<std::unique_ptr<Runtime>> ref = Runtime::Create(model, Make(1, nullptr), ro);
  ASSERT_TRUE(ref.ok()) << ref.status();

  std::mt19937 rng(5);
  std::string ids[2];
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<std::string> id = (r == 0 ? *rt : *ref)->CreateSequence("");
    ASSERT_TRUE(id.ok()) << id.status();
    ids[r] = *id;
  }
  const auto prefill = [&](Runtime* runtime, const std::string& id, int64_t t, const Tensor& q,
                           const Tensor& k, const Tensor& v) {
    PrefillCall call;
    call.sequence_id = id;
    call.layer = 0;
    call.q = Req(q);
    call.k = Req(k);
    call.v = Req(v);
    return runtime->Prefill(call);
  };
  const auto tensors = [&](int64_t t) {
    return std::vector<Tensor>{Random({t, kNumQueryVariants, kHq, kD}, &rng),
                               Random({t, kHkv, kD}, &rng), Random({t, kHkv, kD}, &rng)};
  };
  std::vector<Tensor> first = tensors(40);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(
        prefill((r == 0 ? *rt : *ref).get(), ids[r], 40, first[0], first[1], first[2]).ok());
  }
  const int64_t free_after_first = (*rt)->Info().kv_cache.pages_free;
  ASSERT_EQ(free_after_first, kPages - 3);

  // 60 more tokens need 4 more pages: reserved, then rolled back when shard 1 fails.
  std::vector<Tensor> more = tensors(60);
  faulty->FailNextPrefills(1);
  absl::StatusOr<PrefillResult> failed = prefill(rt->get(), ids[0], 60, more[0], more[1], more[2]);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_EQ((*rt)->Info().kv_cache.pages_free, free_after_first);
  EXPECT_EQ((*rt)->LayerLengths(ids[0], "")->at(0), 40);

  // The decode step fails in shard 1 too, and changes nothing.
  const Tensor dq = Random({kNumQueryVariants, kHq, kD}, &rng), dk = Random({kHkv, kD}, &rng),
               dv = Random({kHkv, kD}, &rng);
  const auto decode = [&](Runtime* runtime, const std::string& id) {
    DecodeCall call;
    call.layer = 0;
    DecodeCall::Entry e;
    e.sequence_id = id;
    e.q = Req(dq);
    e.k = Req(dk);
    e.v = Req(dv);
    call.entries.push_back(e);
    return runtime->Decode(call);
  };
  faulty->FailNextDecodes(1);
  ASSERT_FALSE(decode(rt->get(), ids[0]).ok());
  EXPECT_EQ((*rt)->LayerLengths(ids[0], "")->at(0), 40);
  EXPECT_EQ((*rt)->Info().kv_cache.pages_free, free_after_first);

  // Retried, both give the unsharded engine's outputs.
  absl::StatusOr<PrefillResult> got = prefill(rt->get(), ids[0], 60, more[0], more[1], more[2]);
  absl::StatusOr<PrefillResult> want = prefill(ref->get(), ids[1], 60, more[0], more[1], more[2]);
  ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
  EXPECT_TRUE(got->out == want->out);
  absl::StatusOr<DecodeResult> got_d = decode(rt->get(), ids[0]);
  absl::StatusOr<DecodeResult> want_d = decode(ref->get(), ids[1]);
  ASSERT_TRUE(got_d.ok() && want_d.ok()) << got_d.status() << want_d.status();
  EXPECT_TRUE(got_d->outputs[0].out == want_d->outputs[0].out);
  EXPECT_EQ((*rt)->LayerLengths(ids[0], "")->at(0), 101);
  ASSERT_TRUE((*rt)->ReleaseSequence(ids[0], "").ok());
  EXPECT_EQ((*rt)->Info().kv_cache.pages_free, kPages);
}

TEST(ShardedEngineTest, MismatchedShardsAreRefused) {
  std::vector<std::unique_ptr<Engine>> shards;
  shards.push_back(Make(1, nullptr));  // every head: not a shard of two
  shards.push_back(Make(1, nullptr));
  absl::StatusOr<std::unique_ptr<Engine>> sharded =
      CreateShardedEngine(Geometry(), std::move(shards));
  ASSERT_FALSE(sharded.ok());
  EXPECT_EQ(sharded.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShardedEngineTest, FactoryErrorsNameTheFlag) {
  EngineOptions o;
  o.device = "cpu";
  o.geometry = Geometry();
  o.num_layers = kLayers;
  o.kv_cache_bytes = 1 << 20;
  o.shards = 3;
  absl::StatusOr<std::unique_ptr<Engine>> e = CreateEngine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("3 shards cannot split"), std::string::npos) << e.status();
  o.shards = 0;
  o.devices = {0, 1};
  e = CreateEngine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().message(),
            "EngineOptions::devices names CUDA devices; the cpu backend shards with "
            "EngineOptions::shards");
}

#endif  // !ATTND_SHARDED_ON_CUDA

}  // namespace
}  // namespace attnd
