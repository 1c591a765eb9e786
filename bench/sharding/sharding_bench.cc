// A sharded engine against the unsharded one, in-process, in one run (issue 21's figure): both
// engines built by the daemon's factory from the same model config, fed the same inputs; the
// prefill of whole contexts in chunks and decode steps at several batch sizes are timed on each,
// alternating, and the outputs compared. On one GPU, --devices 0,0 measures what sharding costs
// (two half-size shards on one device); on two, --devices 0,1 what it gains.
//
//   sharding_bench --devices 0,0 [--baseline_devices 0] [--inputs device|host]
//   sharding_bench --device cpu --shards 2 --contexts 2048 --decode_context 1024   (no GPU)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/dtype.h"
#include "bench/common/bench_common.h"
#include "kernels/dca.h"
#include "server/config/model_config.h"
#include "server/config/sparse_config.h"
#include "server/engine/engine.h"
#include "server/engine/engine_factory.h"
#include "server/engine/engine_jobs_for_testing.h"

#ifdef ATTND_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif

ABSL_FLAG(std::string, model_config, "configs/qwen2.5-7b-instruct-1m/config.json",
          "the model (its sparse_attention_config.json too, when present)");
ABSL_FLAG(int32_t, layers, 1, "layers in the pool (the first N of the model; 0 = all)");
ABSL_FLAG(std::string, device, "cuda", "cuda | cpu");
ABSL_FLAG(std::string, devices, "0,0", "cuda: the sharded engine's devices");
ABSL_FLAG(std::string, baseline_devices, "0", "cuda: the engine it is compared with");
ABSL_FLAG(int32_t, shards, 2, "cpu: the sharded engine's shards (the baseline has one)");
ABSL_FLAG(std::string, inputs, "host",
          "host: request tensors in host memory (gRPC bytes, shm regions); device: in GPU memory "
          "(CUDA IPC regions; prefill only)");
ABSL_FLAG(std::string, contexts, "32768,131072", "prefill: tokens per sequence");
ABSL_FLAG(int64_t, chunk, 4096, "prefill: tokens per call");
ABSL_FLAG(std::string, decode_batches, "1,8,32,64", "decode: entries per step");
ABSL_FLAG(int64_t, decode_context, 4096, "decode: tokens in each sequence before the steps");
ABSL_FLAG(int32_t, decode_steps, 200, "decode: timed steps per batch");
ABSL_FLAG(bool, pre_rotary, true, "requests carry q and k before the rotary (else 5 variants)");

namespace attnd {
namespace {

using bench::Clock;
using bench::ParseList;
using bench::Percentile;
using bench::RandomBf16;
using bench::Us;

// The largest |a - b| over bf16 outputs.
double MaxDiff(const std::string& a, const std::string& b) {
  const int64_t n = static_cast<int64_t>(a.size() / 2);
  std::vector<float> fa(n), fb(n);
  ConvertToFloat(a.data(), DType::kBf16, n, fa.data());
  ConvertToFloat(b.data(), DType::kBf16, n, fb.data());
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) worst = std::max<double>(worst, std::fabs(fa[i] - fb[i]));
  return worst;
}

// Request memory: host bytes, or (--inputs device) a device copy of them.
class Buffer {
 public:
  Buffer(const std::string& host, bool on_device) : host_(host), on_device_(on_device) {
#ifdef ATTND_BENCH_CUDA
    if (on_device_) {
      cudaMalloc(&device_, host.size());
      cudaMemcpy(device_, host.data(), host.size(), cudaMemcpyHostToDevice);
    }
#endif
  }
  ~Buffer() {
#ifdef ATTND_BENCH_CUDA
    if (device_ != nullptr) cudaFree(device_);
#endif
  }
  TensorView View(std::vector<int64_t> shape) const {
    TensorView v;
    v.dtype = DType::kBf16;
    v.data = on_device_ ? device_ : host_.data();
    v.shape = std::move(shape);
    v.on_device = on_device_;
    return v;
  }

 private:
  const std::string& host_;
  const bool on_device_;
  void* device_ = nullptr;
};

// An output: host bytes, or device memory copied back to compare.
class Output {
 public:
  Output(int64_t bytes, bool on_device) : host_(bytes, '\0'), on_device_(on_device) {
#ifdef ATTND_BENCH_CUDA
    if (on_device_) cudaMalloc(&device_, bytes);
#endif
  }
  ~Output() {
#ifdef ATTND_BENCH_CUDA
    if (device_ != nullptr) cudaFree(device_);
#endif
  }
  void* data() { return on_device_ ? device_ : host_.data(); }
  const std::string& Read() {
#ifdef ATTND_BENCH_CUDA
    if (on_device_) cudaMemcpy(host_.data(), device_, host_.size(), cudaMemcpyDeviceToHost);
#endif
    return host_;
  }

 private:
  std::string host_;
  const bool on_device_;
  void* device_ = nullptr;
};

struct Bench {
  ModelConfig model;
  std::unique_ptr<Engine> engines[2];  // baseline, sharded
  std::string names[2];
};

absl::StatusOr<std::unique_ptr<Engine>> Build(const ModelConfig& model, int64_t tokens,
                                              bool sharded) {
  EngineOptions o;
  o.device = absl::GetFlag(FLAGS_device);
  o.geometry = model.geometry();
  o.num_layers = model.num_layers;
  o.page_size = 16;
  o.sparse = model.sparse;
  const bool cuda = o.device == "cuda";
  o.kv_dtype = "bf16";
  if (cuda) {
    absl::StatusOr<std::vector<int32_t>> devices = ParseDeviceList(
        sharded ? absl::GetFlag(FLAGS_devices) : absl::GetFlag(FLAGS_baseline_devices));
    if (!devices.ok()) return devices.status();
    o.devices = *devices;
  } else {
    o.shards = sharded ? absl::GetFlag(FLAGS_shards) : 1;
  }
  const int64_t page_bytes =
      int64_t{2} * model.num_layers * 16 * model.num_kv_heads * model.head_dim * 2;
  o.kv_cache_bytes = (tokens / 16 + 64) * page_bytes;
  return CreateEngine(o);
}

// Whole contexts prefilled in chunks on both engines, chunk by chunk alternately; the time is
// the sum of the Prefill calls.
void Prefill(Bench& b, const std::vector<int64_t>& contexts, bool on_device) {
  const DcaGeometry g = b.model.geometry();
  const int64_t t = absl::GetFlag(FLAGS_chunk), hq = g.num_q_heads, hkv = g.num_kv_heads,
                d = g.head_dim;
  const bool pre = absl::GetFlag(FLAGS_pre_rotary);
  const int64_t nv = pre ? 1 : kNumQueryVariants;
  std::mt19937 rng(1);
  const std::string q = RandomBf16(&rng, t * nv * hq * d), k = RandomBf16(&rng, t * hkv * d),
                    v = RandomBf16(&rng, t * hkv * d);
  const Buffer bq(q, on_device), bk(k, on_device), bv(v, on_device);
  for (int64_t context : contexts) {
    std::vector<int32_t> pages(context / 16 + 1);
    for (size_t i = 0; i < pages.size(); ++i) pages[i] = static_cast<int32_t>(i);
    double total[2] = {0, 0}, last[2] = {0, 0}, worst = 0;
    for (int64_t start = 0; start < context; start += t) {
      Output outs[2] = {Output(t * hq * d * 2, on_device), Output(t * hq * d * 2, on_device)};
      for (int e = 0; e < 2; ++e) {
        PrefillJob job = EngineJobsForTesting::Prefill();
        job.layer = 0;
        job.page_table = pages.data();
        job.num_pages = (start + t + 15) / 16;
        job.start = start;
        job.num_tokens = t;
        job.prompt_len = context;
        job.q_layout = pre ? QLayout::kPreRotary : QLayout::kVariants;
        job.q = bq.View(pre ? std::vector<int64_t>{t, hq, d} : std::vector<int64_t>{t, nv, hq, d});
        job.k = bk.View({t, hkv, d});
        job.v = bv.View({t, hkv, d});
        job.out = outs[e].data();
        job.out_dtype = DType::kBf16;
        job.out_on_device = on_device;
        const auto t0 = Clock::now();
        const absl::Status s = b.engines[e]->Prefill(job);
        last[e] = Us(Clock::now() - t0);
        total[e] += last[e];
        if (!s.ok()) {
          std::printf("prefill\t%s\tfailed: %s\n", b.names[e].c_str(),
                      std::string(s.message()).c_str());
          return;
        }
      }
      worst = std::max(worst, MaxDiff(outs[0].Read(), outs[1].Read()));
    }
    const bool sparse = b.model.sparse != nullptr && b.model.sparse->UseSparse(context);
    std::printf(
        "prefill\tcontext %lld%s\t%s inputs\t%s %.1f ms (last chunk %.2f ms)\t%s %.1f ms (last "
        "chunk %.2f ms)\tsharded/baseline %.3f\tmax |diff| %.3g\n",
        static_cast<long long>(context), sparse ? " sparse" : "", on_device ? "device" : "host",
        b.names[0].c_str(), total[0] / 1e3, last[0] / 1e3, b.names[1].c_str(), total[1] / 1e3,
        last[1] / 1e3, total[1] / total[0], worst);
  }
}

// `batch` sequences of decode_context tokens on both engines, then decode steps at the same
// position (the K/V stays as prefilled), alternating engines step by step.
void Decode(Bench& b, const std::vector<int64_t>& batches) {
  const DcaGeometry g = b.model.geometry();
  const int64_t context = absl::GetFlag(FLAGS_decode_context), hq = g.num_q_heads,
                hkv = g.num_kv_heads, d = g.head_dim, chunk = absl::GetFlag(FLAGS_chunk);
  const bool pre = absl::GetFlag(FLAGS_pre_rotary);
  int64_t max_batch = 1;
  for (int64_t x : batches) max_batch = std::max(max_batch, x);
  const int64_t pages_per_seq = context / 16 + 2;
  std::mt19937 rng(3);
  const std::string pq = RandomBf16(&rng, chunk * kNumQueryVariants * hq * d),
                    pk = RandomBf16(&rng, chunk * hkv * d), pv = RandomBf16(&rng, chunk * hkv * d);
  std::string pout(chunk * hq * d * 2, '\0');
  std::vector<std::vector<int32_t>> tables(max_batch);
  for (int64_t s = 0; s < max_batch; ++s) {
    for (int64_t i = 0; i < pages_per_seq; ++i) {
      tables[s].push_back(static_cast<int32_t>(s * pages_per_seq + i));
    }
    for (int64_t start = 0; start < context; start += chunk) {
      const int64_t n = std::min(chunk, context - start);
      for (auto& engine : b.engines) {
        PrefillJob job = EngineJobsForTesting::Prefill();
        job.page_table = tables[s].data();
        job.num_pages = (start + n + 15) / 16;
        job.start = start;
        job.num_tokens = n;
        job.prompt_len = context;
        job.q = TensorView{DType::kBf16, pq.data(), {n, kNumQueryVariants, hq, d}, false};
        job.k = TensorView{DType::kBf16, pk.data(), {n, hkv, d}, false};
        job.v = TensorView{DType::kBf16, pv.data(), {n, hkv, d}, false};
        job.out = pout.data();
        job.out_dtype = DType::kBf16;
        if (absl::Status st = engine->Prefill(job); !st.ok()) {
          std::printf("decode\tprefill failed: %s\n", std::string(st.message()).c_str());
          return;
        }
      }
    }
  }
  const std::string q = RandomBf16(&rng, (pre ? 1 : 3) * hq * d), k = RandomBf16(&rng, hkv * d),
                    v = RandomBf16(&rng, hkv * d);
  for (int64_t batch : batches) {
    std::vector<double> lat[2];
    double worst = 0;
    std::vector<std::string> outs[2];
    for (int e = 0; e < 2; ++e) outs[e].assign(batch, std::string(hq * d * 2, '\0'));
    const int32_t steps = absl::GetFlag(FLAGS_decode_steps);
    for (int it = 0; it < steps + 20; ++it) {
      for (int e = 0; e < 2; ++e) {
        DecodeJob job = EngineJobsForTesting::Decode();
        job.layer = 0;
        for (int64_t s = 0; s < batch; ++s) {
          DecodeJob::Entry entry;
          entry.page_table = tables[s].data();
          entry.num_pages = (context + 16) / 16;
          entry.length = context + 1;
          entry.q = pre ? TensorView{DType::kBf16, q.data(), {hq, d}, false}
                        : TensorView{DType::kBf16, q.data(), {3, hq, d}, false};
          entry.q_layout = pre ? QLayout::kPreRotary : QLayout::kVariants;
          entry.k = TensorView{DType::kBf16, k.data(), {hkv, d}, false};
          entry.v = TensorView{DType::kBf16, v.data(), {hkv, d}, false};
          entry.out = outs[e][s].data();
          entry.out_dtype = DType::kBf16;
          job.entries.push_back(entry);
        }
        const auto t0 = Clock::now();
        const absl::Status st = b.engines[e]->Decode(job).status();
        if (it >= 20) lat[e].push_back(Us(Clock::now() - t0));
        if (!st.ok()) {
          std::printf("decode\t%s\tfailed: %s\n", b.names[e].c_str(),
                      std::string(st.message()).c_str());
          return;
        }
      }
    }
    for (int64_t s = 0; s < batch; ++s) worst = std::max(worst, MaxDiff(outs[0][s], outs[1][s]));
    const double p50[2] = {Percentile(lat[0], 0.5), Percentile(lat[1], 0.5)};
    std::printf(
        "decode\tbatch %lld x %lld\t%s p50 %.1f us p99 %.1f us (%.0f tok/s)\t%s p50 %.1f us p99 "
        "%.1f us (%.0f tok/s)\tsharded/baseline %.3f\tmax |diff| %.3g\n",
        static_cast<long long>(batch), static_cast<long long>(context), b.names[0].c_str(), p50[0],
        Percentile(lat[0], 0.99), 1e6 * batch / p50[0], b.names[1].c_str(), p50[1],
        Percentile(lat[1], 0.99), 1e6 * batch / p50[1], p50[1] / p50[0], worst);
  }
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace attnd;  // NOLINT(build/namespaces)
  absl::StatusOr<ModelConfig> model = LoadModelConfig(absl::GetFlag(FLAGS_model_config));
  if (!model.ok()) {
    std::printf("model: %s\n", model.status().ToString().c_str());
    return 1;
  }
  const int32_t layers = absl::GetFlag(FLAGS_layers);
  if (layers > 0 && layers < model->num_layers) {  // the first layers, and their sparse budgets
    if (model->sparse != nullptr) {
      auto sparse = std::make_shared<SparseAttentionConfig>(*model->sparse);
      sparse->num_layers = layers;
      sparse->budgets.resize(static_cast<size_t>(layers) * sparse->num_q_heads);
      model->sparse = sparse;
    }
    model->num_layers = layers;
  }
  const std::vector<int64_t> contexts = ParseList(absl::GetFlag(FLAGS_contexts));
  const std::vector<int64_t> batches = ParseList(absl::GetFlag(FLAGS_decode_batches));
  int64_t tokens = absl::GetFlag(FLAGS_decode_context) + 64;
  for (int64_t b : batches)
    tokens = std::max(tokens, b * (absl::GetFlag(FLAGS_decode_context) + 32));
  for (int64_t c : contexts) tokens = std::max(tokens, c);
  Bench bench;
  bench.model = *model;
  const bool cuda = absl::GetFlag(FLAGS_device) == "cuda";
  for (int e = 0; e < 2; ++e) {
    absl::StatusOr<std::unique_ptr<Engine>> engine = Build(*model, tokens, e == 1);
    if (!engine.ok()) {
      std::printf("engine %d: %s\n", e, engine.status().ToString().c_str());
      return 1;
    }
    bench.engines[e] = *std::move(engine);
    bench.names[e] = cuda ? bench.engines[e]->device()
                          : absl::StrCat(bench.engines[e]->shards().size(), " cpu shard(s)");
  }
  std::printf("model %s: %d layers, %d q heads, %d kv heads; %s vs %s; %lld pages each\n",
              model->name.c_str(), model->num_layers, model->num_q_heads, model->num_kv_heads,
              bench.names[0].c_str(), bench.names[1].c_str(),
              static_cast<long long>(bench.engines[0]->layout().num_pages));
  const bool on_device = cuda && absl::GetFlag(FLAGS_inputs) == "device";
  if (!contexts.empty()) Prefill(bench, contexts, on_device);
  if (!batches.empty()) Decode(bench, batches);
  return 0;
}
