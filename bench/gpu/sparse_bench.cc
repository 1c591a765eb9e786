// GPU benchmark of the vertical-slash sparse prefill (kernels/cuda/sparse_cuda.h) against the dense
// fused prefill (LaunchDcaPrefill): one sequence, one layer, Qwen2.5-7B-1M geometry (28 q heads,
// 4 kv heads, head_dim 128, chunk_len 253952, original_max_position_embeddings 262144), bf16 paged
// KV (page 16, shuffled pages), the shipped per-head budgets of one layer
// (configs/qwen2.5-7b-instruct-1m/sparse_attention_config.json, vertical 30 read as 130), last_q
// 64, synthetic q/K/V with attention sinks and a local band (sparse_bench_data.h), all L tokens
// prefilled in one call (start 0).
//
//   sparse_bench [--sizes 131072,262144,524288,1048576] [--layers 17,0,8] [--dense 1]
//                [--band smooth|rope] [--config FILE] [--out FILE] [--chunk N]
//                [--kv-dtype int8|fp8]
// --chunk N times only the last N tokens of each size, as one call of a chunked prefill sees them
// (the keys before them already cached), against the dense kernels on the same chunk.
//
// Per size: sparse time (median of runs; CUDA events around the whole call), the estimation share
// (events around each piece's estimation + top-k), the index construction (stage mapping +
// converter) and attention times, the attention's key density (64x64 tiles it attends over the
// dense causal work) and its rate, the workspace bytes, dense time (one run
// after a warm-up at the smallest size) and the sparse output's error vs dense on the same data:
// ||sparse - dense||_2 / ||dense||_2 and max abs, both bf16 outputs.
// --kv-dtype int8 or fp8: also the cost of a one-byte cache in accuracy, as the engine runs it: the
// same K/V quantised into a pool of that dtype (LaunchAppendKv, the CPU's codes), dequantised into
// a bf16 scratch (LaunchDequantizeKv), and the sparse prefill (with --dense 1 the dense one too)
// run over the scratch; each output against the same kernel's over the bf16 pool (relative L2, max
// abs).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/gpu/bench_util.h"
#include "bench/gpu/sparse_bench_data.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/cuda/sparse_cuda.h"
#include "kernels/dca.h"
#include "kernels/paged_kv.h"
#include "kernels/vertical_slash.h"
#include "nlohmann/json.hpp"

namespace attnd {
namespace {

constexpr int kHq = 28, kHkv = 4, kD = 128, kPage = 16;
constexpr int64_t kChunkLen = 253952, kOrig = 262144;

std::vector<int64_t> ParseList(const char* s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

std::vector<VsBudget> LayerBudgets(const nlohmann::json& cfg, int layer) {
  std::vector<VsBudget> b(kHq);
  for (const auto& [head, entry] : cfg.at(layer).items()) {
    const int64_t v = entry.at(1), s = entry.at(2);
    b.at(std::stoi(head)) = VsBudget{v == 30 ? 130 : v, s};
  }
  return b;
}

float ElapsedMs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

// What a pool of CodeT gives the prefill kernels for the same tokens: k_bf16 / v_bf16 hold them in
// order ([len, Hkv, D], identity pages); they are quantised into a pool of CodeT as the engine's
// appends do and come back dequantised, bf16(value * scale), as the engine's prefill scratch.
template <typename CodeT>
void QuantizeIntoScratch(Bf16* k_bf16, Bf16* v_bf16, const int32_t* identity, int64_t len,
                         size_t kv_elems) {
  const size_t rows = kv_elems / kD;
  CodeT *k8 = nullptr, *v8 = nullptr;
  float *ks = nullptr, *vs = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&k8), kv_elems));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&v8), kv_elems));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&ks), rows * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&vs), rows * 4));
  PagedKv<CodeT> pool{k8, v8, identity, kPage, kHkv, kD, ks, vs};
  CudaAppendParamsOf<CodeT> a;
  a.kv = pool;
  a.k = k_bf16;
  a.v = v_bf16;
  a.in_dtype = DType::kBf16;
  a.num_tokens = len;
  CHECK_OK(LaunchAppendKv(a, nullptr));
  CudaDequantizeKvParamsOf<CodeT> d;
  d.kv = pool;
  d.k_out = k_bf16;
  d.v_out = v_bf16;
  d.num_tokens = len;
  CHECK_OK(LaunchDequantizeKv(d, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  for (void* p : {static_cast<void*>(k8), static_cast<void*>(v8), static_cast<void*>(ks),
                  static_cast<void*>(vs)}) {
    CHECK_CUDA(cudaFree(p));
  }
}

int Main(int argc, char** argv) {
  std::vector<int64_t> sizes = {131072, 262144, 524288, 1048576};
  std::vector<int64_t> layers = {17, 0, 8};
  bool dense = true;
  std::string band = "smooth";
  std::string config = "configs/qwen2.5-7b-instruct-1m/sparse_attention_config.json";
  int64_t chunk = 0;  // 0: the whole size in one call
  std::string kv_dtype = "bf16";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--sizes" && i + 1 < argc)
      sizes = ParseList(argv[++i]);
    else if (a == "--layers" && i + 1 < argc)
      layers = ParseList(argv[++i]);
    else if (a == "--dense" && i + 1 < argc)
      dense = std::atoi(argv[++i]) != 0;
    else if (a == "--config" && i + 1 < argc)
      config = argv[++i];
    else if (a == "--band" && i + 1 < argc)
      band = argv[++i];
    else if (a == "--chunk" && i + 1 < argc)
      chunk = std::atoll(argv[++i]);
    else if (a == "--kv-dtype" && i + 1 < argc)
      kv_dtype = argv[++i];
    else if (a == "--out" && i + 1 < argc)
      g_out = std::fopen(argv[++i], "w");
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (kv_dtype != "bf16" && kv_dtype != "int8" && kv_dtype != "fp8") {
    std::fprintf(stderr, "--kv-dtype bf16|int8|fp8\n");
    return 2;
  }
  std::ifstream cf(config);
  const nlohmann::json cfg = nlohmann::json::parse(cf, nullptr, false);
  if (cfg.is_discarded() || !cfg.is_array()) {
    std::fprintf(stderr, "cannot read %s\n", config.c_str());
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  Emit("device: %s, %d SMs; geometry Hq %d Hkv %d D %d chunk_len %ld orig %ld page %d\n", prop.name,
       prop.multiProcessorCount, kHq, kHkv, kD, static_cast<long>(kChunkLen),
       static_cast<long>(kOrig), kPage);
  if (chunk > 0) {
    Emit("timed: the last %ld tokens of each size in one call (a chunked prefill's last call)\n",
         static_cast<long>(chunk));
  }
  for (int64_t layer : layers) {
    const std::vector<VsBudget> b = LayerBudgets(cfg, static_cast<int>(layer));
    int64_t sv = 0, ss = 0;
    for (const VsBudget& x : b) sv += x.vertical, ss += x.slash;
    Emit("layer %ld budgets: sum vertical %ld, sum slash %ld (mean %ld / %ld per head)\n",
         static_cast<long>(layer), static_cast<long>(sv), static_cast<long>(ss),
         static_cast<long>(sv / kHq), static_cast<long>(ss / kHq));
  }

  const int64_t max_len = *std::max_element(sizes.begin(), sizes.end());
  const int64_t pages = (max_len + kPage - 1) / kPage;
  std::vector<int32_t> table(pages);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(5));
  const size_t kv_elems = static_cast<size_t>(pages) * kPage * kHkv * kD;
  Bf16 *k = nullptr, *v = nullptr, *q = nullptr, *out_sparse = nullptr, *out_dense = nullptr;
  int32_t* d_table = nullptr;
  double* d_err = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&k), kv_elems * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&v), kv_elems * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_table), pages * sizeof(int32_t)));
  CHECK_CUDA(cudaMemcpy(d_table, table.data(), pages * sizeof(int32_t), cudaMemcpyHostToDevice));
  const size_t q_elems = static_cast<size_t>(max_len) * kNumQueryVariants * kHq * kD;
  const size_t out_elems = static_cast<size_t>(max_len) * kHq * kD;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&q), q_elems * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&out_sparse), out_elems * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&out_dense), out_elems * sizeof(Bf16)));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_err), (3 + 2 * kHq) * sizeof(double)));
  PagedKv<Bf16> kv{k, v, d_table, kPage, kHkv, kD};
  bench::SyntheticShape shape;
  if (band == "smooth") {  // periods 16K .. 16K * 1.15^31 (~1.2M): a wide, smooth local band
    shape.period_min = 16384.f;
    shape.period_ratio = 1.15f;
  } else if (band == "rope") {  // periods 8 .. ~8K: RoPE-like ripples, scattered far diagonals
    shape.period_min = 8.f;
    shape.period_ratio = 1.25f;
  } else {
    std::fprintf(stderr, "--band smooth|rope\n");
    return 2;
  }
  bench::FillSyntheticKv(k, v, d_table, kPage, max_len, shape, nullptr);
  bench::FillSyntheticQ(q, max_len, shape, nullptr);
  // One-byte KV: the same tokens in order (identity pages), quantised and dequantised in place.
  Bf16 *kq = nullptr, *vq = nullptr, *out_q = nullptr;
  int32_t* d_identity = nullptr;
  if (kv_dtype != "bf16") {
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&kq), kv_elems * sizeof(Bf16)));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&vq), kv_elems * sizeof(Bf16)));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&out_q), out_elems * sizeof(Bf16)));
    std::vector<int32_t> identity(pages);
    std::iota(identity.begin(), identity.end(), 0);
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_identity), pages * sizeof(int32_t)));
    CHECK_CUDA(
        cudaMemcpy(d_identity, identity.data(), pages * sizeof(int32_t), cudaMemcpyHostToDevice));
    bench::FillSyntheticKv(kq, vq, d_identity, kPage, max_len, shape, nullptr);
    if (kv_dtype == "int8") {
      QuantizeIntoScratch<Int8Kv>(kq, vq, d_identity, max_len, kv_elems);
    } else {
      QuantizeIntoScratch<Fp8E4m3>(kq, vq, d_identity, max_len, kv_elems);
    }
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  Emit(
      "synthetic data '%s': noise %.2f band %.2f (64 dims, periods %.0f..%.0f) sinks %d (key "
      "%.0f, query %.0f); q %.1f GB, KV %.2f GB\n",
      band.c_str(), shape.noise, shape.band, shape.period_min,
      shape.period_min * std::pow(shape.period_ratio, 31), shape.sinks, shape.sink_key,
      shape.sink_query, q_elems * 2.0 / 1e9, kv_elems * 4.0 / 1e9);

  DcaGeometry g;
  g.num_q_heads = kHq;
  g.num_kv_heads = kHkv;
  g.head_dim = kD;
  g.chunk_len = kChunkLen;
  g.original_max_position_embeddings = kOrig;
  g.softmax_scale = 1.f / std::sqrt(static_cast<float>(kD));

  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  constexpr int kMaxPieces = 16;
  cudaEvent_t eb[kMaxPieces], ee[kMaxPieces], ei[kMaxPieces];
  for (int i = 0; i < kMaxPieces; ++i) {
    CHECK_CUDA(cudaEventCreate(&eb[i]));
    CHECK_CUDA(cudaEventCreate(&ee[i]));
    CHECK_CUDA(cudaEventCreate(&ei[i]));
  }
  constexpr int kMaxConverts = 256;
  std::vector<cudaEvent_t> cb(kMaxConverts), ce(kMaxConverts);
  for (int i = 0; i < kMaxConverts; ++i) {
    CHECK_CUDA(cudaEventCreate(&cb[i]));
    CHECK_CUDA(cudaEventCreate(&ce[i]));
  }
  unsigned long long* d_tiles = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_tiles), 2 * sizeof(unsigned long long)));
  bool dense_warm = false;
  Emit(
      "\n| L | layer | sparse ms | estimation ms (share) | index ms | attention ms | key density "
      "| attn TFLOP/s | workspace GB | dense ms | speedup | rel. L2 err | max abs err |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const CudaKernelPlan plan = CHECK_OK_VALUE(CudaKernelPlan::Create(g, 0));
  // out_q (a kernel's output over the one-byte scratch) against `want` (the same kernel's over the
  // bf16 pool), `rows` query rows.
  auto report_one_byte = [&](const Bf16* want, int64_t rows, const std::string& what) {
    bench::RelativeError(out_q, want, rows * kHq * kD, kHq, kD, d_err, nullptr);
    double h[3];
    CHECK_CUDA(cudaMemcpy(h, d_err, sizeof(h), cudaMemcpyDeviceToHost));
    Emit("  %s KV, %s output vs the bf16 pool's: rel. L2 %.4f, max abs %.4f\n", kv_dtype.c_str(),
         what.c_str(), std::sqrt(h[0] / h[1]), h[2]);
  };
  for (int64_t len : sizes) {
    CudaPrefillParams p;
    p.kv = kv;
    const int64_t first = chunk > 0 && chunk < len ? len - chunk : 0;  // the timed tokens
    const int64_t rows = len - first;
    p.q = q + static_cast<size_t>(first) * kNumQueryVariants * kHq * kD;
    p.out_dtype = DType::kBf16;
    p.start = first;
    p.num_tokens = rows;
    p.softmax_scale = g.softmax_scale * LengthScale(len, kOrig);
    double dense_ms = -1;
    if (dense) {
      if (!dense_warm) {  // module load / first-launch costs out of the timing
        CudaPrefillParams w = p;
        w.num_tokens = std::min<int64_t>(rows, 16384);
        w.out = out_dense;
        CHECK_OK(LaunchDcaPrefill(plan, w, nullptr));
        CHECK_CUDA(cudaDeviceSynchronize());
        dense_warm = true;
      }
      p.out = out_dense;
      CHECK_CUDA(cudaEventRecord(e0));
      CHECK_OK(LaunchDcaPrefill(plan, p, nullptr));
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      dense_ms = ElapsedMs(e0, e1);
      if (kq != nullptr) {  // the dense prefill over the one-byte pool's scratch: the format alone
        CudaPrefillParams pq = p;
        pq.kv = PagedKv<Bf16>{kq, vq, d_identity, kPage, kHkv, kD};
        pq.out = out_q;
        CHECK_OK(LaunchDcaPrefill(plan, pq, nullptr));
        report_one_byte(out_dense, rows, absl::StrFormat("L %ld: dense", static_cast<long>(len)));
      }
    }
    for (int64_t layer : layers) {
      const std::vector<VsBudget> budgets = LayerBudgets(cfg, static_cast<int>(layer));
      SparsePrefillParams sp;
      sp.prefill = p;
      sp.prefill.out = out_sparse;
      sp.budgets = budgets;
      sp.last_q = 64;
      sp.workspace_bytes = SparsePrefillWorkspaceBytes(g, budgets, first, rows, 64);
      CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&sp.workspace), sp.workspace_bytes));
      SparsePrefillTimers timers;
      timers.estimate_begin = eb;
      timers.estimate_end = ee;
      timers.index_end = ei;
      timers.max_pieces = kMaxPieces;
      timers.convert_begin = cb.data();
      timers.convert_end = ce.data();
      timers.max_converts = kMaxConverts;
      int converts = 0;  // one per slice of each piece
      int pieces = 0;
      for (int64_t b = first; b < len; ++pieces) {  // the call's pieces (DCA chunk boundaries)
        const int64_t end = std::min(len, (b / kChunkLen + 1) * kChunkLen);
        const int64_t rbs = (end - b + 63) / 64;
        converts += static_cast<int>((rbs + kDefaultRowBlockSlice - 1) / kDefaultRowBlockSlice);
        b = end;
      }
      // warm-up + runs: 3 timed runs up to 256K, 2 above
      CHECK_OK(LaunchSparsePrefillTimed(g, sp, timers, nullptr));
      CHECK_CUDA(cudaDeviceSynchronize());
      const int runs = len <= 262144 ? 3 : 2;
      std::vector<double> total, est, index;
      for (int r = 0; r < runs; ++r) {
        timers.tile_stats = r == 0 ? d_tiles : nullptr;
        if (r == 0) CHECK_CUDA(cudaMemset(d_tiles, 0, 2 * sizeof(unsigned long long)));
        CHECK_CUDA(cudaEventRecord(e0));
        CHECK_OK(LaunchSparsePrefillTimed(g, sp, timers, nullptr));
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        total.push_back(ElapsedMs(e0, e1));
        double e = 0, x = 0;
        for (int i = 0; i < std::min(pieces, kMaxPieces); ++i) {
          e += ElapsedMs(eb[i], ee[i]);
          x += ElapsedMs(ee[i], ei[i]);  // stage mapping
        }
        for (int i = 0; i < std::min(converts, kMaxConverts); ++i) x += ElapsedMs(cb[i], ce[i]);
        est.push_back(e);
        index.push_back(x);
      }
      unsigned long long tiles[2];
      CHECK_CUDA(cudaMemcpy(tiles, d_tiles, sizeof(tiles), cudaMemcpyDeviceToHost));
      // Dense work in 64x64 (row, key) units: every row sees keys <= itself, all q heads.
      const double dense_units = static_cast<double>(kHq) *
                                 (static_cast<double>(len) * (len + 1) / 2 -
                                  static_cast<double>(first) * (first + 1) / 2) /
                                 (64.0 * 64.0);
      const double density = tiles[0] / dense_units;
      std::vector<size_t> order(runs);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(),
                [&](size_t a, size_t b) { return total[a] < total[b]; });
      const size_t mid = order[(runs - 1) / 2];
      double rel = -1, worst = -1;
      std::string per_head;
      if (dense) {
        bench::RelativeError(out_sparse, out_dense, rows * kHq * kD, kHq, kD, d_err, nullptr);
        double h[3 + 2 * kHq];
        CHECK_CUDA(cudaMemcpy(h, d_err, sizeof(h), cudaMemcpyDeviceToHost));
        rel = std::sqrt(h[0] / h[1]);
        worst = h[2];
        for (int x = 0; x < kHq; ++x) {
          char buf[96];
          std::snprintf(buf, sizeof(buf), " h%d(%ld/%ld) %.3f", x,
                        static_cast<long>(budgets[x].vertical), static_cast<long>(budgets[x].slash),
                        std::sqrt(h[3 + 2 * x] / h[4 + 2 * x]));
          per_head += buf;
        }
      }
      const double attn_ms = total[mid] - est[mid] - index[mid];
      // 4 * 64 * 64 * D FLOPs per tile (QK^T and PV, 2 per MAC), masked keys included.
      const double tflops = tiles[0] * 4.0 * 64 * 64 * kD / (attn_ms * 1e-3) / 1e12;
      Emit(
          "| %ld | %ld | %.1f | %.1f (%.1f%%) | %.1f | %.1f | %.3f (%llu tiles, %.0f%% columns) "
          "| %.0f | %.2f | %.1f | %.1fx | %.4f | %.4f |\n",
          static_cast<long>(len), static_cast<long>(layer), total[mid], est[mid],
          100.0 * est[mid] / total[mid], index[mid], attn_ms, density, tiles[0],
          100.0 * tiles[1] / std::max(1ull, tiles[0]), tflops, sp.workspace_bytes / 1e9, dense_ms,
          dense_ms > 0 ? dense_ms / total[mid] : 0.0, rel, worst);
      if (!per_head.empty()) {
        Emit("  per-head rel. L2 error, L %ld layer %ld (vertical/slash budget):%s\n",
             static_cast<long>(len), static_cast<long>(layer), per_head.c_str());
      }
      if (kq != nullptr) {  // the same call over the one-byte pool's scratch
        SparsePrefillParams sq = sp;
        sq.prefill.kv = PagedKv<Bf16>{kq, vq, d_identity, kPage, kHkv, kD};
        sq.prefill.out = out_q;
        CHECK_OK(LaunchSparsePrefill(g, sq, nullptr));
        report_one_byte(out_sparse, rows,
                        absl::StrFormat("L %ld layer %ld: sparse", static_cast<long>(len),
                                        static_cast<long>(layer)));
      }
      CHECK_CUDA(cudaFree(sp.workspace));
    }
  }
  size_t free_b = 0, total_b = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  Emit("\ndevice memory at exit: %.1f GB used of %.1f GB (q, KV, two outputs)\n",
       (total_b - free_b) / 1e9, total_b / 1e9);
  return 0;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) { return attnd::Main(argc, argv); }
