// Cutting one prefill call into key-tile windows (CudaPrefillParams::key_tile_begin/end): the whole
// launch against the same call as back-to-back windowed launches on one stream, per window size,
// so the engine can pick a default. A window bounds how long one block (one SM) stays busy, which
// is how long a decode step on a higher-priority stream may wait for an SM. Every windowed run's
// output is also compared with the whole launch's, byte for byte.
//
//   prefill_window_bench [--starts 28672,126976] [--tokens 4096] [--windows 16,32,64,128]
//                        [--reps 5] [--out FILE]
//
// Geometry: the 7B model's (28 q heads, 4 kv heads, head_dim 128), chunk_len 253952 (one DCA
// chunk below 256K, as deployed), 16-token pages, the plan's default kernel. Inputs are synthetic
// (a constant pattern): the kernels' time does not depend on the values.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/gpu/bench_util.h"
#include "kernels/cuda/dca_cuda.h"

ABSL_FLAG(std::string, starts, "28672,126976", "call starts (context before the call)");
ABSL_FLAG(int64_t, tokens, 4096, "tokens per prefill call");
ABSL_FLAG(std::string, windows, "16,32,64,128", "window sizes in key tiles");
ABSL_FLAG(int32_t, reps, 5, "timed repetitions (the median is printed)");
ABSL_FLAG(std::string, out, "", "also write the result lines to this file");

namespace attnd {
namespace {

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 0) {
      std::fprintf(stderr, "bad list entry '%s'\n", std::string(part).c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run() {
  DcaGeometry g;
  g.num_q_heads = 28;
  g.num_kv_heads = 4;
  g.head_dim = 128;
  g.chunk_len = 253952;
  g.original_max_position_embeddings = 0;
  g.softmax_scale = 1.f / std::sqrt(128.f);
  const CudaKernelPlan plan = CHECK_OK_VALUE(CudaKernelPlan::Create(g, 0));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int64_t n = absl::GetFlag(FLAGS_tokens);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const std::vector<int64_t> starts = ParseList(absl::GetFlag(FLAGS_starts));
  const std::vector<int64_t> windows = ParseList(absl::GetFlag(FLAGS_windows));
  Emit("# prefill_window_bench: %s, kernel %s, %d q / %d kv heads, D %d, %lld tokens per call\n",
       prop.name, PrefillKernelName(plan.prefill_kernel()), g.num_q_heads, g.num_kv_heads,
       g.head_dim, static_cast<long long>(n));
  if (!PrefillTakesWindows(plan)) {
    Emit("# the plan's kernel takes no windows\n");
    return 1;
  }
  const int page = 16;
  const int64_t max_keys = *std::max_element(starts.begin(), starts.end()) + n;
  const int64_t pages = (max_keys + page - 1) / page;
  const size_t kv_bytes = static_cast<size_t>(pages) * page * g.num_kv_heads * g.head_dim * 2;
  void *k = nullptr, *v = nullptr, *table = nullptr, *q = nullptr, *out = nullptr, *ref = nullptr,
       *state = nullptr;
  CHECK_CUDA(cudaMalloc(&k, kv_bytes));
  CHECK_CUDA(cudaMalloc(&v, kv_bytes));
  CHECK_CUDA(cudaMemset(k, 0x3c, kv_bytes));
  CHECK_CUDA(cudaMemset(v, 0x3d, kv_bytes));
  std::vector<int32_t> ids(pages);
  std::iota(ids.begin(), ids.end(), 0);
  CHECK_CUDA(cudaMalloc(&table, pages * 4));
  CHECK_CUDA(cudaMemcpy(table, ids.data(), pages * 4, cudaMemcpyHostToDevice));
  const size_t q_bytes =
      static_cast<size_t>(n) * kNumQueryVariants * g.num_q_heads * g.head_dim * 2;
  const size_t out_bytes = static_cast<size_t>(n) * g.num_q_heads * g.head_dim * 4;
  CHECK_CUDA(cudaMalloc(&q, q_bytes));
  CHECK_CUDA(cudaMemset(q, 0x3c, q_bytes));
  CHECK_CUDA(cudaMalloc(&out, out_bytes));
  CHECK_CUDA(cudaMalloc(&ref, out_bytes));
  const size_t state_bytes = PrefillWindowStateBytes(plan, g, n);
  CHECK_CUDA(cudaMalloc(&state, state_bytes));
  Emit("# window state: %.1f MiB per call of %lld tokens\n", state_bytes / 1048576.0,
       static_cast<long long>(n));

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<uint8_t> want(out_bytes), got(out_bytes);

  for (const int64_t start : starts) {
    CudaPrefillParams p;
    p.kv.k = static_cast<Bf16*>(k);
    p.kv.v = static_cast<Bf16*>(v);
    p.kv.page_table = static_cast<const int32_t*>(table);
    p.kv.page_size = page;
    p.kv.num_kv_heads = g.num_kv_heads;
    p.kv.head_dim = g.head_dim;
    p.q = static_cast<const Bf16*>(q);
    p.out = ref;
    p.out_dtype = DType::kFp32;
    p.start = start;
    p.num_tokens = n;
    p.softmax_scale = g.softmax_scale;
    const int64_t tiles = PrefillKeyTiles(plan, g, start, n);
    // The whole launch: warm-up, then the median of reps.
    for (int i = 0; i < 2; ++i) CHECK_OK(LaunchDcaPrefill(plan, p, stream));
    std::vector<double> whole_ms;
    for (int r = 0; r < reps; ++r) {
      CHECK_CUDA(cudaEventRecord(e0, stream));
      CHECK_OK(LaunchDcaPrefill(plan, p, stream));
      CHECK_CUDA(cudaEventRecord(e1, stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      whole_ms.push_back(ms);
    }
    CHECK_CUDA(cudaMemcpy(want.data(), ref, out_bytes, cudaMemcpyDeviceToHost));
    const double whole = Median(whole_ms);
    Emit("start %lld total %lld: whole launch %.3f ms, %lld key tiles per block at most\n",
         static_cast<long long>(start), static_cast<long long>(start + n), whole,
         static_cast<long long>(tiles));

    p.out = out;
    p.window_state = state;
    p.window_state_bytes = state_bytes;
    for (const int64_t w : windows) {
      if (w < 1) continue;
      const int64_t launches = (tiles + w - 1) / w;
      std::vector<cudaEvent_t> marks(launches + 1);
      for (cudaEvent_t& m : marks) CHECK_CUDA(cudaEventCreate(&m));
      std::vector<double> total_ms, max_launch_ms, mean_launch_ms;
      for (int r = 0; r < reps + 1; ++r) {  // the first run warms up
        CHECK_CUDA(cudaMemsetAsync(out, 0xff, out_bytes, stream));
        CHECK_CUDA(cudaEventRecord(marks[0], stream));
        for (int64_t i = 0; i < launches; ++i) {
          p.key_tile_begin = static_cast<int32_t>(i * w);
          p.key_tile_end = static_cast<int32_t>(std::min(tiles, (i + 1) * w));
          CHECK_OK(LaunchDcaPrefill(plan, p, stream));
          CHECK_CUDA(cudaEventRecord(marks[i + 1], stream));
        }
        CHECK_CUDA(cudaEventSynchronize(marks[launches]));
        if (r == 0) continue;
        float all = 0, most = 0;
        CHECK_CUDA(cudaEventElapsedTime(&all, marks[0], marks[launches]));
        for (int64_t i = 0; i < launches; ++i) {
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, marks[i], marks[i + 1]));
          most = std::max(most, ms);
        }
        total_ms.push_back(all);
        max_launch_ms.push_back(most);
        mean_launch_ms.push_back(all / launches);
      }
      for (cudaEvent_t& m : marks) CHECK_CUDA(cudaEventDestroy(m));
      CHECK_CUDA(cudaMemcpy(got.data(), out, out_bytes, cudaMemcpyDeviceToHost));
      const bool same = std::memcmp(got.data(), want.data(), out_bytes) == 0;
      const double all = Median(total_ms);
      Emit(
          "  window %4lld tiles: %4lld launches, total %.3f ms (%+.1f%%), per launch mean %.3f ms "
          "max %.3f ms, output %s\n",
          static_cast<long long>(w), static_cast<long long>(launches), all,
          100.0 * (all / whole - 1.0), Median(mean_launch_ms), Median(max_launch_ms),
          same ? "identical" : "DIFFERENT");
      if (!same) return 1;
    }
    p.key_tile_begin = p.key_tile_end = 0;
    p.window_state = nullptr;
    p.window_state_bytes = 0;
  }
  for (void* ptr : {k, v, table, q, out, ref, state}) cudaFree(ptr);
  return 0;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) attnd::g_out = std::fopen(out.c_str(), "w");
  const int rc = attnd::Run();
  if (attnd::g_out) std::fclose(attnd::g_out);
  return rc;
}
