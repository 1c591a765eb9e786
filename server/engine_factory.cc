#include "server/engine_factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcache/kv_layout.h"
#include "server/cpu_engine.h"

namespace attnd {

absl::StatusOr<DType> ResolveKvDType(const std::string& kv_dtype, const std::string& backend) {
  if (kv_dtype == "fp32") return DType::kFp32;
  if (kv_dtype == "bf16") return DType::kBf16;
  if (kv_dtype == "auto") return backend == "cpu" ? DType::kFp32 : DType::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-dtype must be auto, bf16 or fp32, got \"", kv_dtype, "\""));
}

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const EngineOptions& options) {
  if (options.device == "cuda") {
    return absl::FailedPreconditionError("the CUDA backend is not built yet; use --device=cpu");
  }
  // auto: GPU detection belongs here once the CUDA backend exists.
  if (options.device != "cpu" && options.device != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be auto, cpu or cuda, got \"", options.device, "\""));
  }
  absl::StatusOr<DType> kv_dtype = ResolveKvDType(options.kv_dtype, "cpu");
  if (!kv_dtype.ok()) return kv_dtype.status();
  if (options.kv_cache_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-bytes must be >= 0, got ", options.kv_cache_bytes));
  }
  const int64_t pool_bytes =
      options.kv_cache_bytes > 0 ? options.kv_cache_bytes : DefaultCpuPoolBytes();
  absl::StatusOr<KvLayout> layout =
      KvLayout::ForPoolBytes(options.num_layers, options.geometry.num_kv_heads,
                             options.geometry.head_dim, options.page_size, *kv_dtype, pool_bytes);
  if (!layout.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-bytes ", pool_bytes, ": ", layout.status().message()));
  }
  CpuEngineOptions cpu;
  cpu.geometry = options.geometry;
  cpu.layout = *layout;
  cpu.compute_threads = options.compute_threads;
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(cpu);
  if (!engine.ok()) return engine.status();
  return std::unique_ptr<Engine>(std::move(*engine));
}

}  // namespace attnd
