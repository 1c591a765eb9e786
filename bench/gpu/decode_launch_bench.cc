// Where a decode step's time goes, below the engine: the three kernels of one step
// (LaunchDecodeStage + LaunchDcaDecode's split-K kernel and reduction, exactly as
// server/engine/cuda_engine.cc enqueues them) on one stream, launched eagerly and replayed as a
// CUDA graph, Qwen2.5-7B-1M geometry, bf16 inputs in pinned host memory, sequences of --context
// tokens on shuffled pages of a pool sized like decode_step_bench's.
//
//   decode_launch_bench [--context 4096] [--batches 1,8] [--iters 2000] [--min_split_keys 256,64]
//
// Per batch size and mode, medians over --iters steps of:
//   enqueue   host time of the launch calls (eager: the three kernel launches with their argument
//             checks and cudaFuncSetAttribute; graph: cudaGraphLaunch);
//   step      launch calls + cudaStreamSynchronize, what the engine's step pays on top of its
//             host copies;
//   device    cudaEventElapsedTime between events recorded before and after the launches (the
//             kernels and the gaps between them on the device).
// Plus the floor of any step: a one-element kernel launched and synchronised.
// The KV pool is zeros (no prefill): the kernels' work does not depend on the values.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/gpu/bench_util.h"
#include "bench/gpu/decode_bench_common.h"
#include "kernels/cuda/dca_cuda.h"

ABSL_FLAG(int64_t, context, 4096, "tokens in each sequence");
ABSL_FLAG(std::string, batches, "1,8", "decode batch sizes");
ABSL_FLAG(int32_t, iters, 2000, "timed steps per batch size and mode");
ABSL_FLAG(std::string, min_split_keys, "0",
          "fewest keys in a decode split, comma-separated (each a multiple of 64, 0 = the "
          "kernels' default): one plan each");

namespace attnd {
namespace {

constexpr int kHq = kBenchHq, kHkv = kBenchHkv, kD = kBenchD, kPage = kBenchPage;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double UsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

int Main() {
  const int64_t context = absl::GetFlag(FLAGS_context);
  const int32_t iters = absl::GetFlag(FLAGS_iters);
  const std::optional<std::vector<int32_t>> parsed = ParseBatchList(absl::GetFlag(FLAGS_batches));
  if (!parsed) {
    std::fprintf(stderr,
                 "decode_launch_bench: --batches takes integers in [1, 256], comma-separated\n");
    return 2;
  }
  const std::vector<int32_t>& batches = *parsed;
  const DcaGeometry g = Qwen7bGeometry();
  const int32_t max_b = *std::max_element(batches.begin(), batches.end());
  const int64_t pages_per_seq = (context + kPage - 1) / kPage;
  const int64_t pages = 128 * pages_per_seq + 16;  // decode_step_bench's pool at 128 sequences
  const int64_t stride = (pages + 3) / 4 * 4;      // as the engine's: a multiple of 4
  const int64_t max_length = pages * kPage;
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  std::vector<CudaKernelPlan> plans;
  for (absl::string_view v : absl::StrSplit(absl::GetFlag(FLAGS_min_split_keys), ',')) {
    CudaKernelPlanOptions o;
    if (!absl::SimpleAtoi(v, &o.decode_min_split_keys)) {
      std::fprintf(stderr, "decode_launch_bench: --min_split_keys takes integers\n");
      return 2;
    }
    plans.push_back(CHECK_OK_VALUE(CudaKernelPlan::Create(g, device, o)));
  }

  const size_t token_elems = static_cast<size_t>(kHkv) * kD;
  Bf16 *k_pool = nullptr, *v_pool = nullptr;
  CHECK_CUDA(cudaMalloc(&k_pool, pages * kPage * token_elems * 2));
  CHECK_CUDA(cudaMalloc(&v_pool, pages * kPage * token_elems * 2));
  CHECK_CUDA(cudaMemset(k_pool, 0, pages * kPage * token_elems * 2));
  CHECK_CUDA(cudaMemset(v_pool, 0, pages * kPage * token_elems * 2));
  int32_t *d_tables = nullptr, *h_tables = nullptr, *d_len = nullptr;
  CHECK_CUDA(cudaMalloc(&d_tables, max_b * stride * 4));
  CHECK_CUDA(cudaMallocHost(&h_tables, max_b * stride * 4));
  CHECK_CUDA(cudaMalloc(&d_len, max_b * 4));
  std::mt19937 rng(3);
  std::vector<int32_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  DecodeStageRow* rows = nullptr;
  CHECK_CUDA(cudaMallocHost(&rows, max_b * sizeof(DecodeStageRow)));
  for (int b = 0; b < max_b; ++b) {
    for (int64_t p = 0; p < pages_per_seq; ++p) {
      h_tables[b * stride + p] = perm[b * pages_per_seq + p];
    }
    rows[b].length = static_cast<int32_t>(context);
    rows[b].num_pages = static_cast<int32_t>(pages_per_seq);
    rows[b].q_dtype = rows[b].k_dtype = rows[b].v_dtype = static_cast<int32_t>(DType::kBf16);
  }
  const int64_t q_row = 3 * kHq * kD * 4, kv_row = token_elems * 4;  // fp32-sized slots
  char *h_q = nullptr, *h_k = nullptr, *h_v = nullptr;
  CHECK_CUDA(cudaMallocHost(&h_q, max_b * q_row));
  CHECK_CUDA(cudaMallocHost(&h_k, max_b * kv_row));
  CHECK_CUDA(cudaMallocHost(&h_v, max_b * kv_row));
  std::memset(h_q, 0, max_b * q_row);  // bf16 zeros
  std::memset(h_k, 0, max_b * kv_row);
  std::memset(h_v, 0, max_b * kv_row);
  Bf16* d_q = nullptr;
  CHECK_CUDA(cudaMalloc(&d_q, max_b * 3 * kHq * kD * 2));
  float* h_out = nullptr;
  CHECK_CUDA(cudaMallocHost(&h_out, max_b * kHq * kD * 4));
  size_t workspace = 0;
  for (const CudaKernelPlan& plan : plans) {
    for (int b = 1; b <= max_b; ++b) {
      const int32_t splits = plan.DecodeSplits(b, max_length);
      workspace = std::max(workspace, plan.DecodeWorkspaceFloats(b, splits));
    }
  }
  float* d_work = nullptr;
  CHECK_CUDA(cudaMalloc(&d_work, workspace * 4));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));

  // The floor: a one-element kernel (LaunchConvertToBf16), launched and synchronised.
  std::vector<double> floor_us;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_OK(LaunchConvertToBf16(h_out, DType::kFp32, 1, d_q, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    floor_us.push_back(UsSince(t0));
  }
  std::printf("decode_launch_bench: context %lld, 7B geometry, %d steps per point\n",
              static_cast<long long>(context), iters);
  std::printf("floor: a one-element kernel, launch + sync, median %.1f us\n", Median(floor_us));
  std::printf("min_keys  batch  splits  mode    enqueue_us  step_us  device_us\n");

  for (const CudaKernelPlan& plan : plans)
    for (int32_t b : batches) {
      PagedKvBatch kvb;
      kvb.k = k_pool;
      kvb.v = v_pool;
      kvb.page_tables = d_tables;
      kvb.page_table_stride = stride;
      kvb.page_size = kPage;
      kvb.num_kv_heads = kHkv;
      kvb.head_dim = kD;
      CudaDecodeStageParams sp;
      sp.kv = kvb;
      sp.rows = rows;
      sp.host_tables = h_tables;
      sp.host_q = h_q;
      sp.host_k = h_k;
      sp.host_v = h_v;
      sp.q_row_bytes = q_row;
      sp.kv_row_bytes = kv_row;
      sp.lengths = d_len;
      sp.q = d_q;
      sp.num_q_heads = kHq;
      sp.batch = b;
      sp.original_max_position_embeddings = g.original_max_position_embeddings;
      CudaDecodeParams dp;
      dp.kv = kvb;
      dp.lengths = d_len;
      dp.q = d_q;
      dp.out = h_out;
      dp.out_dtype = DType::kFp32;
      dp.batch = b;
      dp.max_splits = plan.DecodeSplits(b, max_length);
      dp.partial_out = d_work;
      dp.partial_lse = d_work + static_cast<size_t>(b) * kHq * dp.max_splits * kD;
      auto enqueue = [&] {
        CHECK_OK(LaunchDecodeStage(sp, stream));
        CHECK_OK(LaunchDcaDecode(plan, dp, stream));
      };
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      enqueue();
      CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
      CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      CHECK_CUDA(cudaGraphUpload(exec, stream));
      for (const bool use_graph : {true, false}) {
        std::vector<double> enq, step, dev;
        for (int i = 0; i < iters + 50; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          if (use_graph) {
            CHECK_CUDA(cudaGraphLaunch(exec, stream));
          } else {
            enqueue();
          }
          const double e = UsSince(t0);
          CHECK_CUDA(cudaStreamSynchronize(stream));
          const double s = UsSince(t0);
          // Device time in a separate step (recording events would add to the host-timed one).
          CHECK_CUDA(cudaEventRecord(e0, stream));
          if (use_graph) {
            CHECK_CUDA(cudaGraphLaunch(exec, stream));
          } else {
            enqueue();
          }
          CHECK_CUDA(cudaEventRecord(e1, stream));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          if (i < 50) continue;  // warm-up
          enq.push_back(e);
          step.push_back(s);
          dev.push_back(ms * 1000.0);
        }
        std::printf("%-8d  %-5d  %-6d  %-6s  %10.1f  %7.1f  %9.1f\n", plan.DecodeMinSplitKeys(), b,
                    dp.max_splits, use_graph ? "graph" : "eager", Median(enq), Median(step),
                    Median(dev));
      }
      CHECK_CUDA(cudaGraphExecDestroy(exec));
      CHECK_CUDA(cudaGraphDestroy(graph));
    }
  return 0;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attnd::Main();
}
