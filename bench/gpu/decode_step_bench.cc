// One decode step of one layer through the CUDA engine (server/engine/cuda_engine.h), CUDA graph
// replay against eager launches, Qwen2.5-7B-1M geometry (28 q heads, 4 kv heads, head_dim 128),
// bf16, int8 or fp8 KV (--kv-dtype bf16,int8,fp8 times each on the same inputs and prints each
// one-byte dtype's speedup over bf16),
// page_size 16, shuffled pages.
//
//   decode_step_bench [--context 4096] [--batches 1,8,32,128] [--iters 300] [--capture-layers 28]
//                     [--kv-dtype bf16 | int8 | fp8 | bf16,int8,fp8]
//                     [--inputs host | device] [--q-layout variants | pre_rotary]
//
// A step is what the server's decode path costs a batch: Engine::Decode, host-timed from the call
// to its return (copy the entries and page tables into pinned slots, then either one graph replay
// or the eager launches of the stage kernel, split-K attention and reduction; synchronise; copy
// the outputs out). Each batch size reuses the first B of 128 sequences prefilled with
// `--context` - 1 random tokens; every step decodes position context - 1 again (the engine
// rewrites the same KV slot), so lengths stay fixed. Median and p99 of --iters steps after a
// warm-up. Two engines: graphs on and off (--disable-cuda-graphs), same inputs.
//
// --inputs device puts every entry's q, k, v and output in device memory of the engine's GPU, as a
// client's CUDA IPC regions reach the engine: the step is then the kernels alone (no host staging,
// no copy back), so the difference to --inputs host is what staging costs. --q-layout pre_rotary
// sends q [Hq, D] and k before the rotary, as a model runtime does (the engine rotates them).
//
// Also the start-up cost of graphs at the full model depth: engines with --capture-layers layers
// created with and without graphs (wall time, and the engine's own log line with the graph count,
// capture time and device memory).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "bench/gpu/decode_bench_common.h"
#include "kernels/dca.h"
#include "kvcache/kv_layout.h"
#include "server/engine/cuda_engine.h"
#include "server/engine/engine.h"
#include "server/engine/engine_jobs_for_testing.h"

ABSL_FLAG(int64_t, context, 4096, "tokens in each sequence at the timed decode step");
ABSL_FLAG(std::string, batches, "1,8,32,128", "decode batch sizes to time");
ABSL_FLAG(int32_t, iters, 300, "timed steps per batch size and mode");
ABSL_FLAG(int32_t, capture_layers, 28, "layers of the start-up cost engines (0 = skip)");
ABSL_FLAG(std::string, kv_dtype, "bf16", "KV dtypes to time, comma-separated: bf16, int8, fp8");
ABSL_FLAG(std::string, inputs, "host",
          "where the decode entries' q, k, v and outputs live: host or device (the engine's GPU)");
ABSL_FLAG(std::string, q_layout, "variants", "decode q layout: variants or pre_rotary");
ABSL_FLAG(int32_t, decode_min_split_keys, 0,
          "fewest keys in a decode split (a multiple of 64; 0 = the kernels' default)");

namespace attnd {
namespace {

constexpr int kHq = kBenchHq, kHkv = kBenchHkv, kD = kBenchD, kPage = kBenchPage;

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "decode_step_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

CudaEngineOptions Options(int32_t layers, int64_t pages, bool graphs, DType kv_dtype = DType::kBf16,
                          bool rotary = false) {
  CudaEngineOptions o;
  o.geometry = Qwen7bGeometry();
  if (rotary) {  // Qwen2.5-7B-1M's (rope_theta 1e7 on every dim): the engine takes pre-rotary rows
    o.geometry.chunk_size = 262144;
    o.geometry.rope_theta = 10000000.0;
    o.geometry.rotary_dim = kD;
  }
  o.layout.num_layers = layers;
  o.layout.num_kv_heads = kHkv;
  o.layout.head_dim = kD;
  o.layout.page_size = kPage;
  o.layout.kv_dtype = kv_dtype;
  o.layout.num_pages = pages;
  o.max_decode_batch = 256;
  o.cuda_graphs = graphs;
  o.decode_min_split_keys = absl::GetFlag(FLAGS_decode_min_split_keys);
  return o;
}

std::vector<uint16_t> RandomBf16(int64_t n, std::mt19937* rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<uint16_t> out(n);
  for (uint16_t& x : out) x = FloatToBf16(dist(*rng));
  return out;
}

struct Timing {
  double p50 = 0, p99 = 0;
};

Timing Summarise(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  Timing t;
  t.p50 = us[us.size() / 2];
  t.p99 = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  return t;
}

int Main() {
  const int64_t context = absl::GetFlag(FLAGS_context);
  const int32_t iters = absl::GetFlag(FLAGS_iters);
  const std::optional<std::vector<int32_t>> parsed = ParseBatchList(absl::GetFlag(FLAGS_batches));
  if (!parsed) {
    std::fprintf(stderr,
                 "decode_step_bench: --batches takes integers in [1, 256], comma-separated\n");
    return 2;
  }
  const std::vector<int32_t>& batches = *parsed;
  std::vector<DType> dtypes;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_kv_dtype), ',')) {
    if (name != "bf16" && name != "int8" && name != "fp8") {
      std::fprintf(stderr, "decode_step_bench: --kv-dtype takes bf16, int8 and fp8, got \"%s\"\n",
                   std::string(name).c_str());
      return 2;
    }
    dtypes.push_back(name == "bf16"   ? DType::kBf16
                     : name == "int8" ? DType::kInt8
                                      : DType::kFp8E4m3);
  }
  const std::string inputs = absl::GetFlag(FLAGS_inputs);
  const std::string q_layout_name = absl::GetFlag(FLAGS_q_layout);
  if ((inputs != "host" && inputs != "device") ||
      (q_layout_name != "variants" && q_layout_name != "pre_rotary")) {
    std::fprintf(stderr,
                 "decode_step_bench: --inputs takes host or device and --q-layout variants or "
                 "pre_rotary, got \"%s\" and \"%s\"\n",
                 inputs.c_str(), q_layout_name.c_str());
    return 2;
  }
  const bool on_device = inputs == "device";
  const bool pre_rotary = q_layout_name == "pre_rotary";
  const int64_t q_rows = pre_rotary ? 1 : 3;
  const int32_t max_b = *std::max_element(batches.begin(), batches.end());
  const int64_t pages_per_seq = (context + kPage - 1) / kPage;
  const int64_t pages = max_b * pages_per_seq + 16;
  std::mt19937 rng(5);
  std::vector<int32_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);

  // Shared random inputs: one prompt's q/k/v for every sequence (different pages, so no sharing in
  // the cache), and per-entry decode q/k/v.
  const int64_t prompt = context - 1;
  const std::vector<uint16_t> pq = RandomBf16(prompt * kNumQueryVariants * kHq * kD, &rng);
  const std::vector<uint16_t> pk = RandomBf16(prompt * kHkv * kD, &rng);
  const std::vector<uint16_t> pv = RandomBf16(prompt * kHkv * kD, &rng);
  std::vector<std::vector<uint16_t>> dq, dk, dv;
  for (int i = 0; i < max_b; ++i) {
    dq.push_back(RandomBf16(q_rows * kHq * kD, &rng));
    dk.push_back(RandomBf16(kHkv * kD, &rng));
    dv.push_back(RandomBf16(kHkv * kD, &rng));
  }
  std::vector<float> out(static_cast<size_t>(max_b) * kHq * kD);
  // --inputs device: the same values in one device buffer per tensor kind, entry i at row i.
  const int64_t q_n = q_rows * kHq * kD, kv_n = int64_t{kHkv} * kD;
  uint16_t *d_q = nullptr, *d_k = nullptr, *d_v = nullptr;
  float* d_out = nullptr;
  if (on_device) {
    const auto device_copy = [&](const std::vector<std::vector<uint16_t>>& rows, int64_t n,
                                 uint16_t** dst) {
      if (cudaMalloc(dst, static_cast<size_t>(max_b) * n * 2) != cudaSuccess) return false;
      for (int i = 0; i < max_b; ++i) {
        if (cudaMemcpy(*dst + i * n, rows[i].data(), n * 2, cudaMemcpyHostToDevice) != cudaSuccess)
          return false;
      }
      return true;
    };
    if (!device_copy(dq, q_n, &d_q) || !device_copy(dk, kv_n, &d_k) ||
        !device_copy(dv, kv_n, &d_v) ||
        cudaMalloc(&d_out, out.size() * sizeof(float)) != cudaSuccess) {
      std::fprintf(stderr, "decode_step_bench: device inputs: %s\n",
                   cudaGetErrorString(cudaGetLastError()));
      return 1;
    }
  }

  std::printf(
      "decode_step_bench: context %lld, one layer, 7B geometry, %d steps per point, %s inputs, "
      "%s q\n",
      static_cast<long long>(context), iters, inputs.c_str(), q_layout_name.c_str());
  std::printf("%-6s %-6s %-5s %12s %12s %14s\n", "batch", "mode", "kv", "p50_us", "p99_us",
              "tokens_per_s");
  // results[dtype index][mode]
  std::vector<std::vector<std::vector<Timing>>> results(dtypes.size(),
                                                        std::vector<std::vector<Timing>>(2));
  for (size_t di = 0; di < dtypes.size(); ++di)
    for (int mode = 0; mode < 2; ++mode) {
      const bool graphs = mode == 0;
      auto engine = CreateCudaEngine(Options(1, pages, graphs, dtypes[di], pre_rotary));
      if (!engine.ok()) Die("create", engine.status());
      std::vector<uint8_t> pout(static_cast<size_t>(prompt) * kHq * kD * 2);
      for (int i = 0; i < max_b; ++i) {
        PrefillJob job = EngineJobsForTesting::Prefill();
        job.page_table = perm.data() + i * pages_per_seq;
        job.num_pages = pages_per_seq;
        job.num_tokens = prompt;
        job.prompt_len = prompt;
        job.q = TensorView{DType::kBf16, pq.data(), {prompt, kNumQueryVariants, kHq, kD}};
        job.k = TensorView{DType::kBf16, pk.data(), {prompt, kHkv, kD}};
        job.v = TensorView{DType::kBf16, pv.data(), {prompt, kHkv, kD}};
        job.out = pout.data();
        job.out_dtype = DType::kBf16;
        if (absl::Status s = (*engine)->Prefill(job); !s.ok()) Die("prefill", s);
      }
      for (int32_t b : batches) {
        DecodeJob job = EngineJobsForTesting::Decode();
        for (int i = 0; i < b; ++i) {
          DecodeJob::Entry e;
          e.page_table = perm.data() + i * pages_per_seq;
          e.num_pages = pages_per_seq;
          e.length = context;
          const std::vector<int64_t> q_shape =
              pre_rotary ? std::vector<int64_t>{kHq, kD} : std::vector<int64_t>{3, kHq, kD};
          if (on_device) {
            e.q = TensorView{DType::kBf16, d_q + i * q_n, q_shape, true};
            e.k = TensorView{DType::kBf16, d_k + i * kv_n, {kHkv, kD}, true};
            e.v = TensorView{DType::kBf16, d_v + i * kv_n, {kHkv, kD}, true};
            e.out = d_out + static_cast<size_t>(i) * kHq * kD;
            e.out_on_device = true;
          } else {
            e.q = TensorView{DType::kBf16, dq[i].data(), q_shape};
            e.k = TensorView{DType::kBf16, dk[i].data(), {kHkv, kD}};
            e.v = TensorView{DType::kBf16, dv[i].data(), {kHkv, kD}};
            e.out = out.data() + static_cast<size_t>(i) * kHq * kD;
          }
          e.out_dtype = DType::kFp32;
          e.q_layout = pre_rotary ? QLayout::kPreRotary : QLayout::kVariants;
          job.entries.push_back(e);
        }
        std::vector<double> us;
        bool replayed = false;
        for (int it = 0; it < iters + 20; ++it) {
          const auto t0 = std::chrono::steady_clock::now();
          absl::StatusOr<DecodeStats> ran = (*engine)->Decode(job);
          if (!ran.ok()) Die("decode", ran.status());
          replayed = ran->graph_replays > 0;
          const auto t1 = std::chrono::steady_clock::now();
          if (it >= 20) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
        if (replayed != graphs) {
          std::fprintf(stderr, "decode_step_bench: batch %d: replayed=%d with graphs=%d\n", b,
                       replayed, graphs);
          return 1;
        }
        const Timing t = Summarise(us);
        results[di][mode].push_back(t);
        std::printf("%-6d %-6s %-5s %12.1f %12.1f %14.0f\n", b, graphs ? "graph" : "eager",
                    std::string(DTypeName(dtypes[di])).c_str(), t.p50, t.p99, b * 1e6 / t.p50);
        std::fflush(stdout);
      }
    }
  for (size_t di = 0; di < dtypes.size(); ++di) {
    std::printf("\nsummary, %s KV (eager p50 / graph p50):\n",
                std::string(DTypeName(dtypes[di])).c_str());
    for (size_t i = 0; i < batches.size(); ++i) {
      std::printf("  batch %-4d graph %8.1f us  eager %8.1f us  speedup %.2fx\n", batches[i],
                  results[di][0][i].p50, results[di][1][i].p50,
                  results[di][1][i].p50 / results[di][0][i].p50);
    }
  }
  const auto bf = std::find(dtypes.begin(), dtypes.end(), DType::kBf16);
  for (size_t di = 0; bf != dtypes.end() && di < dtypes.size(); ++di) {
    if (dtypes[di] == DType::kBf16) continue;
    const size_t b16 = static_cast<size_t>(bf - dtypes.begin());
    const std::string name(DTypeName(dtypes[di]));
    std::printf("\n%s vs bf16 KV (graph p50; batch x context tokens):\n", name.c_str());
    for (size_t i = 0; i < batches.size(); ++i) {
      std::printf("  batch %-4d %9lld tokens  bf16 %8.1f us  %s %8.1f us  %s speedup %.2fx\n",
                  batches[i], static_cast<long long>(batches[i] * context), results[b16][0][i].p50,
                  name.c_str(), results[di][0][i].p50, name.c_str(),
                  results[b16][0][i].p50 / results[di][0][i].p50);
    }
  }

  const int32_t layers = absl::GetFlag(FLAGS_capture_layers);
  if (layers > 0) {
    // A pool of 16K pages (8 GiB at 28 layers) to see the start-up cost of graphs at full depth.
    for (int mode = 0; mode < 2; ++mode) {
      const auto t0 = std::chrono::steady_clock::now();
      auto engine = CreateCudaEngine(Options(layers, 16384, mode == 0));
      if (!engine.ok()) Die("create (capture)", engine.status());
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::printf("start-up: %d layers, graphs %s: engine created in %.1f ms\n", layers,
                  mode == 0 ? "on" : "off", ms);
    }
  }
  return 0;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attnd::Main();
}
