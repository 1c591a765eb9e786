#include "server/engine_factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcache/kv_layout.h"
#include "server/cpu_engine.h"
#include "server/cuda_engine.h"

namespace attnd {

absl::StatusOr<DType> ResolveKvDType(const std::string& kv_dtype, const std::string& backend) {
  if (kv_dtype == "fp32") return DType::kFp32;
  if (kv_dtype == "bf16") return DType::kBf16;
  if (kv_dtype == "auto") return backend == "cpu" ? DType::kFp32 : DType::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-dtype must be auto, bf16 or fp32, got \"", kv_dtype, "\""));
}

namespace {

absl::StatusOr<KvLayout> LayoutFor(const EngineOptions& options, DType kv_dtype,
                                   int64_t pool_bytes) {
  absl::StatusOr<KvLayout> layout =
      KvLayout::ForPoolBytes(options.num_layers, options.geometry.num_kv_heads,
                             options.geometry.head_dim, options.page_size, kv_dtype, pool_bytes);
  if (!layout.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-bytes ", pool_bytes, ": ", layout.status().message()));
  }
  return layout;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCuda(const EngineOptions& options) {
  if (absl::Status built = CudaBuildStatus(); !built.ok()) return built;
  absl::StatusOr<DType> kv_dtype = ResolveKvDType(options.kv_dtype, "cuda");
  if (!kv_dtype.ok()) return kv_dtype.status();
  if (*kv_dtype != DType::kBf16) {
    return absl::InvalidArgumentError(
        "--kv-dtype: the cuda backend stores K/V as bf16; use auto or bf16");
  }
  if (CudaDeviceCount() == 0) {
    return absl::FailedPreconditionError(
        "--device=cuda: no usable CUDA device (no GPU or no driver); use --device=cpu");
  }
  int64_t pool_bytes = options.kv_cache_bytes;
  if (pool_bytes == 0) {
    if (!(options.kv_cache_fraction > 0 && options.kv_cache_fraction <= 0.98)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv-cache-fraction must be in (0, 0.98], got ", options.kv_cache_fraction));
    }
    absl::StatusOr<int64_t> free_bytes = CudaFreeMemoryBytes(0);
    if (!free_bytes.ok()) return free_bytes.status();
    // The engine's own staging and workspace buffers come out of the remainder.
    pool_bytes = static_cast<int64_t>(static_cast<double>(*free_bytes) * options.kv_cache_fraction);
  }
  absl::StatusOr<KvLayout> layout = LayoutFor(options, *kv_dtype, pool_bytes);
  if (!layout.ok()) return layout.status();
  CudaEngineOptions cuda;
  cuda.geometry = options.geometry;
  cuda.layout = *layout;
  cuda.max_decode_batch = options.max_decode_batch;
  cuda.graph_batch_sizes = options.cuda_graph_batch_sizes;
  cuda.cuda_graphs = options.cuda_graphs;
  cuda.sparse = options.sparse;
  return CreateCudaEngine(cuda);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const EngineOptions& options) {
  if (options.device != "cpu" && options.device != "auto" && options.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be auto, cpu or cuda, got \"", options.device, "\""));
  }
  if (options.kv_cache_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-bytes must be >= 0, got ", options.kv_cache_bytes));
  }
  if (options.device == "cuda" || (options.device == "auto" && CudaDeviceCount() > 0)) {
    return CreateCuda(options);
  }
  absl::StatusOr<DType> kv_dtype = ResolveKvDType(options.kv_dtype, "cpu");
  if (!kv_dtype.ok()) return kv_dtype.status();
  const int64_t pool_bytes =
      options.kv_cache_bytes > 0 ? options.kv_cache_bytes : DefaultCpuPoolBytes();
  absl::StatusOr<KvLayout> layout = LayoutFor(options, *kv_dtype, pool_bytes);
  if (!layout.ok()) return layout.status();
  CpuEngineOptions cpu;
  cpu.geometry = options.geometry;
  cpu.layout = *layout;
  cpu.compute_threads = options.compute_threads;
  cpu.sparse = options.sparse;
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(cpu);
  if (!engine.ok()) return engine.status();
  return std::unique_ptr<Engine>(std::move(*engine));
}

}  // namespace attnd
