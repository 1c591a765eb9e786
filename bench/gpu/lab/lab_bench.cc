// GPU benchmark of the CUDA DCA kernels: the product's launches (kernels/cuda/dca_cuda.h, through
// a CudaKernelPlan) beside the tuning lab's configurations (lab_kernels.h), Qwen2.5-7B-1M geometry
// (28 q heads, 4 kv heads, head_dim 128), bf16 paged KV with page_size 16 and shuffled pages.
//
//   lab_bench [--quick] [--prefill-only | --decode-only] [--configs 5,13|none]
//             [--decode-configs 2,3|none] [--one-byte] [--out FILE]
//
// Rows "product ..." are the product's launches; the others are lab configurations by index
// (default: all of them). --configs none / --decode-configs none: the product's rows only.
//
// Prefill: one sequence, all L tokens in one call (start 0), L in {8K, 32K, 128K}, with
// chunk_len = L/4 (4 DCA chunks: intra, succ and inter stages all active) and the real 253952.
//   FLOPs = 4 * Hq * D * L(L+1)/2   (QK^T and PV, 2 FLOPs per MAC, every query sees keys <= itself,
//   as in causal attention; DCA only changes which query variant scores each key)
// Decode: batch {1, 8, 32, 128} x context {4K, 32K, 128K} plus 1 x 1M, chunk_len 253952; every
// sequence of the batch has the same length. Bytes = K + V read once = B * L * Hkv * D * 2 * 2
// (q, out and page tables are < 1% and not counted). Small cases rotate over several disjoint page
// sets (>= 1 GiB of KV in total) so that repeated runs do not measure the 50 MB L2.
// --one-byte: the product's decode over int8 and fp8 pools of the same cases beside bf16 (bytes =
// the codes and their fp32 scales, B * L * Hkv * (D + 4) * 2), with each one's speedup over bf16.
// Also a device-to-device copy (bytes = read + write) as the bandwidth ceiling.
// Timing: CUDA events around each launch after warm-up; the median of N runs.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/dtype.h"
#include "bench/gpu/bench_util.h"
#include "bench/gpu/lab/lab_kernels.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/dca.h"
#include "kernels/paged_kv.h"

namespace attnd {
namespace {

constexpr int kHq = 28, kHkv = 4, kD = 128, kPageSize = 16;
constexpr int64_t kRealChunkLen = 253952;
constexpr int64_t kOrig = 262144;

DcaGeometry Geometry(int64_t cl) {
  DcaGeometry g;
  g.num_q_heads = kHq;
  g.num_kv_heads = kHkv;
  g.head_dim = kD;
  g.chunk_len = cl;
  g.original_max_position_embeddings = kOrig;
  g.softmax_scale = 1.f / std::sqrt(static_cast<float>(kD));
  return g;
}

// Fills `bytes` of device memory with a tiled block of random unit-scale bf16 values (never zeros).
void FillRandomBf16(void* dst, size_t bytes) {
  static std::vector<uint16_t> block;
  static void* d_block = nullptr;
  constexpr size_t kBlockElems = size_t{16} << 20;  // 32 MB
  if (d_block == nullptr) {
    std::mt19937 rng(42);
    std::normal_distribution<float> dist(0.f, 1.f);
    block.resize(kBlockElems);
    for (auto& x : block) x = FloatToBf16(dist(rng));
    CHECK_CUDA(cudaMalloc(&d_block, kBlockElems * 2));
    CHECK_CUDA(cudaMemcpy(d_block, block.data(), kBlockElems * 2, cudaMemcpyHostToDevice));
  }
  for (size_t off = 0; off < bytes; off += kBlockElems * 2) {
    CHECK_CUDA(cudaMemcpy(static_cast<char*>(dst) + off, d_block,
                          std::min(kBlockElems * 2, bytes - off), cudaMemcpyDeviceToDevice));
  }
}

// Fills `bytes` of device memory with a tiled block of random one-byte codes that are finite both
// as int8 and as E4M3 (magnitude bits below 0x7e: no NaN code, |int8| <= 125).
void FillRandomCodes(void* dst, size_t bytes) {
  static void* d_block = nullptr;
  constexpr size_t kBlockBytes = size_t{32} << 20;
  if (d_block == nullptr) {
    std::mt19937 rng(43);
    std::uniform_int_distribution<int> magnitude(0, 0x7d), sign(0, 1);
    std::vector<uint8_t> block(kBlockBytes);
    for (auto& c : block) c = static_cast<uint8_t>(magnitude(rng) | (sign(rng) << 7));
    CHECK_CUDA(cudaMalloc(&d_block, kBlockBytes));
    CHECK_CUDA(cudaMemcpy(d_block, block.data(), kBlockBytes, cudaMemcpyHostToDevice));
  }
  for (size_t off = 0; off < bytes; off += kBlockBytes) {
    CHECK_CUDA(cudaMemcpy(static_cast<char*>(dst) + off, d_block,
                          std::min(kBlockBytes, bytes - off), cudaMemcpyDeviceToDevice));
  }
}

template <typename F>
double MedianMs(int warmup, int iters, F&& launch) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) launch(i);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    launch(i);
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double CopyBandwidth() {
  const size_t bytes = size_t{4} << 30;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const double ms = MedianMs(
      3, 10, [&](int) { CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

// Prefill rows: kProductWgmma and kProductMmaSync are the product's plan (default, and with the
// fallback forced); indices >= 0 are lab configurations.
constexpr int kProductWgmma = -1, kProductMmaSync = -2;
std::string ConfigLabel(int config) {
  if (config == kProductWgmma) return "product default*";
  if (config == kProductMmaSync) return "product mma.sync";
  return lab::PrefillConfigLabel(config);
}

// Rows to time: the product's mma.sync first (every other row's output is compared with it), the
// product's default, then the lab configurations in `configs`.
std::vector<int> PrefillOrder(const std::vector<int>& configs) {
  std::vector<int> order = {kProductMmaSync, kProductWgmma};
  order.insert(order.end(), configs.begin(), configs.end());
  return order;
}

void BenchPrefill(bool quick, const std::vector<int>& configs) {
  Emit("\n## Prefill (one call of L tokens from position 0; bf16 q/KV, bf16 out; page 16)\n");
  Emit("FLOPs = 4*Hq*D*L(L+1)/2 (causal-equivalent), Hq=28 Hkv=4 D=128\n");
  Emit(
      "vs_%s: max / mean abs difference from that row's output over the last <= 8192 "
      "tokens (all q heads)\n",
      ConfigLabel(kProductMmaSync).c_str());
  Emit("%-8s %-10s %-7s %-16s %12s %10s %10s %10s\n", "L", "chunk_len", "chunks", "variant",
       "median_ms", "TFLOP/s", "max_diff", "mean_diff");
  std::vector<int64_t> lens = {8192, 32768, 131072};
  if (quick) lens = {8192};
  for (int64_t len : lens) {
    const int64_t pages = len / kPageSize;
    const size_t kv_bytes = static_cast<size_t>(pages) * kPageSize * kHkv * kD * 2;
    const size_t q_bytes = static_cast<size_t>(len) * kNumQueryVariants * kHq * kD * 2;
    const size_t out_bytes = static_cast<size_t>(len) * kHq * kD * 2;
    void *k, *v, *q, *out, *table;
    CHECK_CUDA(cudaMalloc(&k, kv_bytes));
    CHECK_CUDA(cudaMalloc(&v, kv_bytes));
    CHECK_CUDA(cudaMalloc(&q, q_bytes));
    CHECK_CUDA(cudaMalloc(&out, out_bytes));
    CHECK_CUDA(cudaMalloc(&table, pages * 4));
    FillRandomBf16(k, kv_bytes);
    FillRandomBf16(v, kv_bytes);
    FillRandomBf16(q, q_bytes);
    std::vector<int32_t> perm(pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(1));
    CHECK_CUDA(cudaMemcpy(table, perm.data(), pages * 4, cudaMemcpyHostToDevice));
    const int64_t check_tokens = std::min<int64_t>(len, 8192);
    const size_t check_elems = static_cast<size_t>(check_tokens) * kHq * kD;
    const size_t check_offset = out_bytes - check_elems * 2;
    for (int64_t cl : {len / 4, kRealChunkLen}) {
      std::vector<uint16_t> base(check_elems), got(check_elems);
      const DcaGeometry g = Geometry(cl);
      CudaKernelPlanOptions mma;
      mma.prefill = PrefillKernel::kMmaSync;
      const CudaKernelPlan plan = CHECK_OK_VALUE(CudaKernelPlan::Create(g, 0));
      const CudaKernelPlan mma_plan = CHECK_OK_VALUE(CudaKernelPlan::Create(g, 0, mma));
      for (int variant : PrefillOrder(configs)) {
        // The real chunk_len past 8K: the mma.sync fallback and the wgmma kernels only (time).
        if (cl == kRealChunkLen && len > 8192 && !quick && variant >= 0 &&
            lab::kPrefillConfigs[variant].family == lab::kMmaSync &&
            variant != lab::kProductMmaSyncConfig) {
          continue;
        }
        CudaPrefillParams p;
        p.kv.k = static_cast<Bf16*>(k);
        p.kv.v = static_cast<Bf16*>(v);
        p.kv.page_table = static_cast<int32_t*>(table);
        p.kv.page_size = kPageSize;
        p.kv.num_kv_heads = kHkv;
        p.kv.head_dim = kD;
        p.q = static_cast<Bf16*>(q);
        p.out = out;
        p.out_dtype = DType::kBf16;
        p.start = 0;
        p.num_tokens = len;
        p.softmax_scale = g.softmax_scale * LengthScale(len, kOrig);
        auto launch = [&] {
          if (variant == kProductWgmma) return LaunchDcaPrefill(plan, p, nullptr);
          if (variant == kProductMmaSync) return LaunchDcaPrefill(mma_plan, p, nullptr);
          return lab::LaunchLabPrefill(g, p, variant, nullptr);
        };
        CHECK_CUDA(cudaMemset(out, 0xff, out_bytes));  // NaN: an unwritten output shows
        const int iters = len >= 131072 ? 3 : 7;
        const double ms = MedianMs(1, iters, [&](int) { CHECK_OK(launch()); });
        const double flops = 4.0 * kHq * kD * static_cast<double>(len) * (len + 1) / 2;
        std::vector<uint16_t>& dst = variant == kProductMmaSync ? base : got;
        CHECK_CUDA(cudaMemcpy(dst.data(), static_cast<char*>(out) + check_offset, check_elems * 2,
                              cudaMemcpyDeviceToHost));
        double max_diff = 0, sum_diff = 0;
        for (size_t i = 0; i < check_elems; ++i) {
          const double d = std::fabs(static_cast<double>(Bf16ToFloat(dst[i])) -
                                     static_cast<double>(Bf16ToFloat(base[i])));
          max_diff = std::isfinite(d) ? std::max(max_diff, d) : INFINITY;
          sum_diff += d;
        }
        Emit("%-8lld %-10lld %-7lld %-16s %12.3f %10.1f %10.3g %10.3g\n",
             static_cast<long long>(len), static_cast<long long>(cl),
             static_cast<long long>((len + cl - 1) / cl), ConfigLabel(variant).c_str(), ms,
             flops / (ms * 1e-3) / 1e12, max_diff, sum_diff / check_elems);
      }
    }
    CHECK_CUDA(cudaFree(k));
    CHECK_CUDA(cudaFree(v));
    CHECK_CUDA(cudaFree(q));
    CHECK_CUDA(cudaFree(out));
    CHECK_CUDA(cudaFree(table));
  }
}

// Decode rows: kProductDecode is the product's plan (ring depth by batch); indices >= 0 are lab
// configurations.
constexpr int kProductDecode = -1;
std::string DecodeVariantLabel(int v) {
  return v == kProductDecode ? "product*" : lab::DecodeConfigLabel(v);
}

// Every decode variant in `variants` on every case, over one shared KV pool (filled once, sized
// for the largest case); each case rotates over disjoint page sets of >= 1 GiB in total. Prints a
// line per (case, variant) and then a compact table (GB/s, % of copy; the best per row marked).
// max_diff: largest |out - out of the first variant| on the case's last run (bf16 outputs).
struct DecodeCase {
  int batch;
  int64_t ctx;
};
std::vector<DecodeCase> DecodeCases(bool quick) {
  if (quick) return {{1, 4096}, {8, 32768}, {32, 32768}};
  std::vector<DecodeCase> cases;
  for (int b : {1, 8, 32, 128})
    for (int64_t ctx : {4096, 32768, 131072}) cases.push_back({b, ctx});
  cases.push_back({1, 1 << 20});
  return cases;
}
// Disjoint page sets a case rotates over: >= 1 GiB of bf16 KV in all.
int DecodeSets(const DecodeCase& c) {
  const double step_bytes = 2.0 * c.batch * c.ctx * kHkv * kD * 2;
  return static_cast<int>(std::max(1.0, std::ceil((1 << 30) / step_bytes)));
}

// Largest pool (in pages) the cases need: each case's sets of its batch's sequences.
int64_t DecodePoolPages(const std::vector<DecodeCase>& cases) {
  int64_t pages = 0;
  for (const DecodeCase& c : cases) {
    pages = std::max<int64_t>(pages, c.ctx / kPageSize * c.batch * DecodeSets(c));
  }
  return pages;
}

// Case `ci`'s device buffers: random q, the output, the page tables of its sets (disjoint pages of
// a pool of pool_pages, shuffled), the lengths and a split-K workspace of ws_floats floats.
struct DecodeCaseBuffers {
  DecodeCase c;
  int64_t pages_per_seq;
  size_t out_elems;
  void *q = nullptr, *out = nullptr, *tables = nullptr, *lengths = nullptr, *ws = nullptr;

  DecodeCaseBuffers(const DecodeCase& dc, size_t ci, int64_t pool_pages, size_t ws_floats)
      : c(dc),
        pages_per_seq(dc.ctx / kPageSize),
        out_elems(static_cast<size_t>(dc.batch) * kHq * kD) {
    std::vector<int32_t> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(2 + ci));
    perm.resize(pages_per_seq * c.batch * DecodeSets(c));
    const size_t q_bytes = static_cast<size_t>(c.batch) * kNumDecodeVariants * kHq * kD * 2;
    CHECK_CUDA(cudaMalloc(&q, q_bytes));
    FillRandomBf16(q, q_bytes);
    CHECK_CUDA(cudaMalloc(&out, out_elems * 2));
    CHECK_CUDA(cudaMalloc(&tables, perm.size() * 4));
    CHECK_CUDA(cudaMemcpy(tables, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(c.batch, static_cast<int32_t>(c.ctx));
    CHECK_CUDA(cudaMalloc(&lengths, c.batch * 4));
    CHECK_CUDA(cudaMemcpy(lengths, lens.data(), c.batch * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&ws, ws_floats * 4));
  }
  ~DecodeCaseBuffers() {
    for (void* p : {q, out, tables, lengths, ws}) CHECK_CUDA(cudaFree(p));
  }
  DecodeCaseBuffers(const DecodeCaseBuffers&) = delete;
  DecodeCaseBuffers& operator=(const DecodeCaseBuffers&) = delete;

  // Every field of p but the pool's data pointers, for page set `set` and `splits` splits.
  template <typename Params>
  void Fill(Params& p, int set, int32_t splits) const {
    p.kv.page_tables =
        static_cast<int32_t*>(tables) + static_cast<int64_t>(set) * c.batch * pages_per_seq;
    p.kv.page_table_stride = pages_per_seq;
    p.kv.page_size = kPageSize;
    p.kv.num_kv_heads = kHkv;
    p.kv.head_dim = kD;
    p.lengths = static_cast<int32_t*>(lengths);
    p.q = static_cast<Bf16*>(q);
    p.out = out;
    p.out_dtype = DType::kBf16;
    p.batch = c.batch;
    p.max_splits = splits;
    p.partial_out = static_cast<float*>(ws);
    p.partial_lse = p.partial_out + static_cast<size_t>(c.batch) * kHq * splits * kD;
  }
};

void BenchDecodeVariants(bool quick, double copy_gbs, const std::vector<int>& variants) {
  using Case = DecodeCase;
  const std::vector<Case> cases = DecodeCases(quick);
  const DcaGeometry g = Geometry(kRealChunkLen);
  const auto sets_of = DecodeSets;
  const int64_t pool_pages = DecodePoolPages(cases);
  const size_t kv_bytes = static_cast<size_t>(pool_pages) * kPageSize * kHkv * kD * 2;
  void *k, *v;
  CHECK_CUDA(cudaMalloc(&k, kv_bytes));
  CHECK_CUDA(cudaMalloc(&v, kv_bytes));
  FillRandomBf16(k, kv_bytes);
  FillRandomBf16(v, kv_bytes);
  Emit(
      "\n## Decode variants (chunk_len 253952, page 16, all sequences of length ctx; KV pool "
      "%.1f GB, shuffled pages)\n",
      2.0 * kv_bytes / 1e9);
  Emit(
      "bytes = B*ctx*Hkv*D*2(K,V)*2B; %%copy = of the D2D copy bandwidth %.0f GB/s; median of 30\n",
      copy_gbs);
  const CudaKernelPlan plan = CHECK_OK_VALUE(CudaKernelPlan::Create(g, 0));
  Emit(
      "product: ring depth 2 while batch x %d kv heads <= %d SMs x %d blocks, else 3 (%d "
      "blocks/SM)\n",
      kHkv, plan.num_sms(), plan.DecodeBlocksPerSm(2), plan.DecodeBlocksPerSm(3));
  for (int vi : variants) {
    if (vi < 0) continue;
    const lab::DecodeKernelConfig& dv = lab::kDecodeConfigs[vi];
    Emit("%s: %d warps, %d keys/tile, %d stages\n", DecodeVariantLabel(vi).c_str(), dv.warps,
         16 * dv.warps, dv.stages);
  }
  auto splits_of = [&](int vi, int batch, int64_t ctx) {
    return vi == kProductDecode ? plan.DecodeSplits(batch, ctx)
                                : lab::LabDecodeSplits(g, batch, ctx, vi);
  };
  Emit("%-6s %-8s %-16s %-7s %-5s %11s %9s %7s %10s\n", "batch", "ctx", "variant", "splits", "sets",
       "median_us", "GB/s", "%copy", "max_diff");
  std::vector<std::vector<double>> table(cases.size(), std::vector<double>(variants.size(), 0));
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    const double step_bytes = 2.0 * c.batch * c.ctx * kHkv * kD * 2;
    const int sets = sets_of(c);
    size_t ws_floats = 0;
    for (int vi : variants) {
      ws_floats =
          std::max(ws_floats, plan.DecodeWorkspaceFloats(c.batch, splits_of(vi, c.batch, c.ctx)));
    }
    const DecodeCaseBuffers buf(c, ci, pool_pages, ws_floats);
    void* const out = buf.out;
    const size_t out_elems = buf.out_elems;
    std::vector<uint16_t> first(out_elems), got(out_elems);
    for (size_t vj = 0; vj < variants.size(); ++vj) {
      const int vi = variants[vj];
      const int32_t splits = splits_of(vi, c.batch, c.ctx);
      auto params = [&](int set) {
        CudaDecodeParams p;
        buf.Fill(p, set, splits);
        p.kv.k = static_cast<Bf16*>(k);
        p.kv.v = static_cast<Bf16*>(v);
        return p;
      };
      CHECK_CUDA(cudaMemset(out, 0xff, out_elems * 2));  // NaN: an unwritten output shows
      auto launch = [&](const CudaDecodeParams& p) {
        return vi == kProductDecode ? LaunchDcaDecode(plan, p, nullptr)
                                    : lab::LaunchLabDecode(g, p, vi, nullptr);
      };
      const double ms = MedianMs(3, 30, [&](int i) { CHECK_OK(launch(params(i % sets))); });
      // One more run on set 0 for the output comparison.
      CHECK_OK(launch(params(0)));
      CHECK_CUDA(cudaDeviceSynchronize());
      std::vector<uint16_t>& dst = vj == 0 ? first : got;
      CHECK_CUDA(cudaMemcpy(dst.data(), out, out_elems * 2, cudaMemcpyDeviceToHost));
      double max_diff = 0;
      for (size_t i = 0; i < out_elems; ++i) {
        const double d = std::fabs(static_cast<double>(Bf16ToFloat(dst[i])) -
                                   static_cast<double>(Bf16ToFloat(first[i])));
        max_diff = std::isfinite(d) ? std::max(max_diff, d) : INFINITY;
      }
      const double gbs = step_bytes / (ms * 1e-3) / 1e9;
      table[ci][vj] = gbs;
      Emit("%-6d %-8lld %-16s %-7d %-5d %11.1f %9.0f %6.0f%% %10.3g\n", c.batch,
           static_cast<long long>(c.ctx), DecodeVariantLabel(vi).c_str(), splits, sets, ms * 1e3,
           gbs, 100.0 * gbs / copy_gbs, max_diff);
    }
  }
  CHECK_CUDA(cudaFree(k));
  CHECK_CUDA(cudaFree(v));
  // Compact table: GB/s (% of copy), '<' marks the row's best.
  Emit("\n## Decode variants summary: GB/s (%% of copy %.0f GB/s); < = best in the row\n",
       copy_gbs);
  Emit("%-11s", "batch x ctx");
  for (int vi : variants) Emit(" %17s", DecodeVariantLabel(vi).c_str());
  Emit("\n");
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    char name[24];
    std::snprintf(name, sizeof(name), "%d x %lldK", cases[ci].batch,
                  static_cast<long long>(cases[ci].ctx / 1024));
    Emit("%-11s", name);
    const size_t best = static_cast<size_t>(std::max_element(table[ci].begin(), table[ci].end()) -
                                            table[ci].begin());
    for (size_t vj = 0; vj < variants.size(); ++vj) {
      char cell[32];
      std::snprintf(cell, sizeof(cell), "%.0f (%.0f%%)%s", table[ci][vj],
                    100.0 * table[ci][vj] / copy_gbs, vj == best ? "<" : " ");
      Emit(" %17s", cell);
    }
    Emit("\n");
  }
}

// The product's decode kernel over a bf16 pool and over int8 and fp8 pools of the same shape (one
// plan per KV dtype, as the engine builds it), every case of BenchDecodeVariants on the same page
// sets. Values are random (codes finite in both formats, scales 1/64): the kernels' work does not
// depend on them.
void BenchDecodeOneByte(bool quick, double copy_gbs) {
  const std::vector<DecodeCase> cases = DecodeCases(quick);
  const DcaGeometry g = Geometry(kRealChunkLen);
  const int64_t pool_pages = DecodePoolPages(cases);
  const size_t elems = static_cast<size_t>(pool_pages) * kPageSize * kHkv * kD;
  const size_t rows = static_cast<size_t>(pool_pages) * kPageSize * kHkv;
  void *k16, *v16, *k8, *v8, *ks, *vs;
  CHECK_CUDA(cudaMalloc(&k16, elems * 2));
  CHECK_CUDA(cudaMalloc(&v16, elems * 2));
  CHECK_CUDA(cudaMalloc(&k8, elems));
  CHECK_CUDA(cudaMalloc(&v8, elems));
  CHECK_CUDA(cudaMalloc(&ks, rows * 4));
  CHECK_CUDA(cudaMalloc(&vs, rows * 4));
  FillRandomBf16(k16, elems * 2);
  FillRandomBf16(v16, elems * 2);
  FillRandomCodes(k8, elems);
  FillRandomCodes(v8, elems);
  const std::vector<float> scales(rows, 1.f / 64);
  CHECK_CUDA(cudaMemcpy(ks, scales.data(), rows * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(vs, scales.data(), rows * 4, cudaMemcpyHostToDevice));
  // The product's plan for each dtype, then fp8 with the ring depth forced (2, 3) at every batch,
  // against the plan's rule (depth 3 once the blocks of a 2-deep ring overflow one wave), then the
  // lab's P V from registers (LaunchVRegsDecode) for both one-byte dtypes, whose outputs are
  // compared with the product's for the same dtype (`same` names that column).
  struct Column {
    DType dtype;
    int32_t stages;
    const char* label;
    bool v_regs = false;
    int same = -1;
  };
  const Column columns[] = {{DType::kBf16, 0, "bf16"},
                            {DType::kInt8, 0, "int8"},
                            {DType::kFp8E4m3, 0, "fp8"},
                            {DType::kFp8E4m3, 2, "fp8 ring 2"},
                            {DType::kFp8E4m3, 3, "fp8 ring 3"},
                            {DType::kInt8, 0, "int8 v-regs", true, 1},
                            {DType::kFp8E4m3, 0, "fp8 v-regs", true, 2}};
  constexpr int kColumns = sizeof(columns) / sizeof(columns[0]);
  unsigned long long* cycles = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&cycles),
                        lab::kDecodeProbeSlots * sizeof(unsigned long long)));
  std::vector<std::string> probes;
  std::vector<CudaKernelPlan> plans;
  for (const Column& col : columns) {
    CudaKernelPlanOptions o;
    o.kv_dtype = col.dtype;
    o.decode_stages = col.stages;
    plans.push_back(CHECK_OK_VALUE(CudaKernelPlan::Create(g, 0, o)));
  }
  Emit(
      "\n## Decode over one-byte KV: the product's kernel, bf16 / int8 / fp8 pools (median of "
      "30)\n");
  Emit(
      "bytes: bf16 B*ctx*Hkv*D*2*2B; int8, fp8 B*ctx*Hkv*(D+4)*2 (codes and scales); blocks/SM "
      "(ring 2/3): bf16 %d/%d, int8 %d/%d, fp8 %d/%d\n",
      plans[0].DecodeBlocksPerSm(2), plans[0].DecodeBlocksPerSm(3), plans[1].DecodeBlocksPerSm(2),
      plans[1].DecodeBlocksPerSm(3), plans[2].DecodeBlocksPerSm(2), plans[2].DecodeBlocksPerSm(3));
  Emit("each column: us (%% of copy) and, past bf16, the speedup over bf16\n%-11s %-5s",
       "batch x ctx", "sets");
  for (const Column& col : columns) Emit(" %24s", col.label);
  Emit("\n");
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const DecodeCase& c = cases[ci];
    const int sets = DecodeSets(c);
    // Each column's splits: the plan's, or the lab kernel's at its own occupancy.
    int32_t splits[kColumns];
    size_t ws_floats = 0;
    for (int di = 0; di < kColumns; ++di) {
      const CudaKernelPlan& plan = plans[di];
      splits[di] = !columns[di].v_regs ? plan.DecodeSplits(c.batch, c.ctx)
                   : columns[di].dtype == DType::kInt8
                       ? lab::VRegsDecodeSplits<Int8Kv>(plan, c.batch, c.ctx)
                       : lab::VRegsDecodeSplits<Fp8E4m3>(plan, c.batch, c.ctx);
      if (splits[di] < 1) {
        std::fprintf(stderr, "lab_bench: no split plan for %s\n", columns[di].label);
        std::exit(1);
      }
      ws_floats = std::max(ws_floats, plan.DecodeWorkspaceFloats(c.batch, splits[di]));
    }
    const DecodeCaseBuffers buf(c, ci, pool_pages, ws_floats);
    int column = 0;  // the column `fill` is building params for
    auto fill = [&](auto& p, const CudaKernelPlan&, int set) { buf.Fill(p, set, splits[column]); };
    // The params over the one-byte pool, its codes read as CodeT.
    auto codes = [&](auto code, const CudaKernelPlan& plan, int set) {
      using CodeT = decltype(code);
      CudaDecodeParamsOf<CodeT> p;
      fill(p, plan, set);
      p.kv.k = static_cast<CodeT*>(k8);
      p.kv.v = static_cast<CodeT*>(v8);
      p.kv.k_scale = static_cast<float*>(ks);
      p.kv.v_scale = static_cast<float*>(vs);
      return p;
    };
    // launch(plan, params) with dtype di's params over page set `set`.
    auto with_params = [&](int di, int set, auto&& launch) {
      const CudaKernelPlan& plan = plans[di];
      column = di;
      if (columns[di].dtype == DType::kBf16) {
        CudaDecodeParams p;
        fill(p, plan, set);
        p.kv.k = static_cast<Bf16*>(k16);
        p.kv.v = static_cast<Bf16*>(v16);
        CHECK_OK(launch(plan, p));
      } else if (columns[di].dtype == DType::kInt8) {
        CHECK_OK(launch(plan, codes(Int8Kv{}, plan, set)));
      } else {
        CHECK_OK(launch(plan, codes(Fp8E4m3{}, plan, set)));
      }
    };
    double us[kColumns];
    std::vector<std::vector<uint16_t>> outs(kColumns);
    std::string diffs;
    for (int di = 0; di < kColumns; ++di) {
      auto launch = [&](const CudaKernelPlan& plan, const auto& p) -> absl::Status {
        using P = std::decay_t<decltype(p)>;
        if constexpr (!std::is_same<P, CudaDecodeParams>::value) {
          if (columns[di].v_regs) return lab::LaunchVRegsDecode(plan, p, nullptr);
        }
        return LaunchDcaDecode(plan, p, nullptr);
      };
      const double ms = MedianMs(3, 30, [&](int i) { with_params(di, i % sets, launch); });
      us[di] = ms * 1e3;
      // One more run on set 0 for the outputs (bf16), compared where a column names its twin.
      CHECK_CUDA(cudaMemset(buf.out, 0xff, buf.out_elems * 2));
      with_params(di, 0, launch);
      CHECK_CUDA(cudaDeviceSynchronize());
      outs[di].resize(buf.out_elems);
      CHECK_CUDA(cudaMemcpy(outs[di].data(), buf.out, buf.out_elems * 2, cudaMemcpyDeviceToHost));
      if (columns[di].same >= 0) {
        double max_diff = 0;
        for (size_t e = 0; e < buf.out_elems; ++e) {
          const double d = std::fabs(static_cast<double>(Bf16ToFloat(outs[di][e])) -
                                     Bf16ToFloat(outs[columns[di].same][e]));
          max_diff = std::isfinite(d) ? std::max(max_diff, d) : INFINITY;
        }
        diffs += absl::StrFormat("  %s vs %s: max abs %.3g", columns[di].label,
                                 columns[columns[di].same].label, max_diff);
      }
      // One more run with the clock probes: each phase's cycles per warp tile.
      CHECK_CUDA(cudaMemset(cycles, 0, lab::kDecodeProbeSlots * sizeof(unsigned long long)));
      with_params(di, 0, [&](const CudaKernelPlan& plan, const auto& p) {
        return lab::LaunchProbedDecode(plan, p, cycles, nullptr, columns[di].v_regs);
      });
      CHECK_CUDA(cudaDeviceSynchronize());
      unsigned long long got[lab::kDecodeProbeSlots];
      CHECK_CUDA(cudaMemcpy(got, cycles, sizeof(got), cudaMemcpyDeviceToHost));
      std::string line;
      const double tiles = static_cast<double>(std::max(1ull, got[lab::kDecodeProbeTiles]));
      for (int ph = 0; ph < lab::kDecodeProbeTiles; ++ph) {
        line += absl::StrFormat(" %s %.0f", lab::DecodeProbePhaseName(ph), got[ph] / tiles);
      }
      probes.push_back(absl::StrFormat("%d x %lldK %s (%.0f warp tiles):%s", c.batch,
                                       static_cast<long long>(c.ctx / 1024), columns[di].label,
                                       tiles, line));
    }
    const double tokens = static_cast<double>(c.batch) * c.ctx * kHkv * 2;
    char name[24];
    std::snprintf(name, sizeof(name), "%d x %lldK", c.batch, static_cast<long long>(c.ctx / 1024));
    Emit("%-11s %-5d", name, sets);
    for (int di = 0; di < kColumns; ++di) {
      const double bytes = tokens * (columns[di].dtype == DType::kBf16 ? kD * 2 : kD + 4);
      const double pct = 100.0 * bytes / (us[di] * 1e-6) / 1e9 / copy_gbs;
      Emit(" %24s",
           di == 0 ? absl::StrFormat("%.1f (%.0f%%)", us[di], pct).c_str()
                   : absl::StrFormat("%.1f (%.0f%%) %.2fx", us[di], pct, us[0] / us[di]).c_str());
    }
    Emit("%s\n", diffs.c_str());
  }
  Emit(
      "\nclock cycles per warp tile by phase (the product's kernel with probes, one run on page "
      "set 0; the prologue and merge are once a warp, spread over its tiles):\n");
  for (const std::string& line : probes) Emit("  %s\n", line.c_str());
  for (void* p : {k16, v16, k8, v8, ks, vs, static_cast<void*>(cycles)}) CHECK_CUDA(cudaFree(p));
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  bool quick = false, prefill_only = false, decode_only = false, one_byte = false;
  // --configs 5,13: lab prefill configurations beside the product's rows (default all; none).
  std::vector<int> configs, decode_configs;
  for (int v = 0; v < attnd::lab::kNumPrefillConfigs; ++v) configs.push_back(v);
  for (int v = 0; v < attnd::lab::kNumDecodeConfigs; ++v) decode_configs.push_back(v);
  auto parse_list = [](const std::string& list, std::vector<int>* out) {
    out->clear();
    if (list == "none") return;
    for (size_t pos = 0; pos < list.size();) {
      const size_t comma = std::min(list.find(',', pos), list.size());
      out->push_back(std::atoi(list.substr(pos, comma - pos).c_str()));
      pos = comma + 1;
    }
  };
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--prefill-only") == 0) prefill_only = true;
    if (std::strcmp(argv[i], "--decode-only") == 0) decode_only = true;
    if (std::strcmp(argv[i], "--one-byte") == 0) one_byte = true;
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc)
      attnd::g_out = std::fopen(argv[++i], "w");
    if (std::strcmp(argv[i], "--configs") == 0 && i + 1 < argc) parse_list(argv[++i], &configs);
    if (std::strcmp(argv[i], "--decode-configs") == 0 && i + 1 < argc) {
      parse_list(argv[++i], &decode_configs);
    }
  }
  for (int v : configs) {
    if (v < 0 || v >= attnd::lab::kNumPrefillConfigs) {
      std::fprintf(stderr, "lab_bench: prefill configuration %d not in 0..%d\n", v,
                   attnd::lab::kNumPrefillConfigs - 1);
      return 2;
    }
  }
  for (int v : decode_configs) {
    if (v < 0 || v >= attnd::lab::kNumDecodeConfigs) {
      std::fprintf(stderr, "lab_bench: decode configuration %d not in 0..%d\n", v,
                   attnd::lab::kNumDecodeConfigs - 1);
      return 2;
    }
  }
  decode_configs.insert(decode_configs.begin(), -1);  // the product's row first
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "lab_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  attnd::Emit("# lab_bench on %s (%d SMs, %.0f MB L2, compute capability %d.%d)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.major, prop.minor);
  const double copy = attnd::CopyBandwidth();
  attnd::Emit("D2D copy bandwidth (4 GiB, read+write): %.0f GB/s\n", copy);
  if (!decode_only) attnd::BenchPrefill(quick, configs);
  if (!prefill_only) attnd::BenchDecodeVariants(quick, copy, decode_configs);
  if (!prefill_only && one_byte) attnd::BenchDecodeOneByte(quick, copy);
  if (attnd::g_out) std::fclose(attnd::g_out);
  return 0;
}
