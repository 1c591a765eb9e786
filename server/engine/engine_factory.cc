#include "server/engine/engine_factory.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "kvcache/kv_layout.h"
#include "server/engine/cpu_engine.h"
#include "server/engine/cuda_engine.h"
#include "server/engine/sharded_engine.h"

namespace attnd {

absl::StatusOr<std::vector<int32_t>> ParseDeviceList(absl::string_view text) {
  std::vector<int32_t> devices;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t d = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--devices must be a comma-separated list of CUDA device ordinals (e.g. 0,1 or 0,0), "
          "got \"",
          text, "\""));
    }
    devices.push_back(d);
  }
  return devices;
}

absl::StatusOr<DType> ResolveKvDType(const std::string& kv_dtype, const std::string& backend) {
  if (kv_dtype == "fp32") return DType::kFp32;
  if (kv_dtype == "bf16") return DType::kBf16;
  if (kv_dtype == "fp8") return DType::kFp8E4m3;
  if (kv_dtype == "int8") return DType::kInt8;
  if (kv_dtype == "auto") return backend == "cpu" ? DType::kFp32 : DType::kBf16;
  return absl::InvalidArgumentError(absl::StrCat(
      "EngineOptions::kv_dtype must be auto, bf16, fp32, fp8 or int8, got \"", kv_dtype, "\""));
}

namespace {

// The pool layout of one shard of `geometry` (its kv heads) with as many pages as fit in
// pool_bytes; the error names the pool size.
absl::StatusOr<KvLayout> LayoutFor(const EngineOptions& options, const DcaGeometry& geometry,
                                   DType kv_dtype, int64_t pool_bytes) {
  absl::StatusOr<KvLayout> layout =
      KvLayout::ForPoolBytes(options.num_layers, geometry.num_kv_heads, geometry.head_dim,
                             options.page_size, kv_dtype, pool_bytes);
  if (!layout.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV pool of ", pool_bytes, " bytes: ", layout.status().message()));
  }
  return layout;
}

// Shard i of n: its geometry (a slice of the heads), its sparse budgets and its layout, whose
// num_pages every shard shares.
struct ShardPlan {
  DcaGeometry geometry;
  std::shared_ptr<const SparseAttentionConfig> sparse;
  KvLayout layout;
};

absl::StatusOr<std::vector<ShardPlan>> PlanShards(const EngineOptions& options, int32_t n,
                                                  DType kv_dtype, int64_t num_pages) {
  ATTND_ASSIGN_OR_RETURN(const DcaGeometry geometry, ShardGeometry(options.geometry, n));
  std::vector<ShardPlan> plans(n);
  for (int32_t i = 0; i < n; ++i) {
    plans[i].geometry = geometry;
    plans[i].sparse =
        options.sparse == nullptr || n == 1
            ? options.sparse
            : ShardSparse(*options.sparse, i * geometry.num_q_heads, geometry.num_q_heads);
    KvLayout& layout = plans[i].layout;
    layout.num_layers = options.num_layers;
    layout.num_kv_heads = geometry.num_kv_heads;
    layout.head_dim = geometry.head_dim;
    layout.page_size = options.page_size;
    layout.kv_dtype = kv_dtype;
    layout.num_pages = num_pages;
  }
  return plans;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCuda(const EngineOptions& options) {
  if (absl::Status built = CudaBuildStatus(); !built.ok()) return built;
  absl::StatusOr<DType> kv_dtype = ResolveKvDType(options.kv_dtype, "cuda");
  if (!kv_dtype.ok()) return kv_dtype.status();
  if (*kv_dtype != DType::kBf16 && !HasRowScale(*kv_dtype)) {
    return absl::InvalidArgumentError(
        "EngineOptions::kv_dtype: the cuda backend stores K/V as bf16, int8 or fp8; use auto, "
        "bf16, int8 or fp8");
  }
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError(
        "EngineOptions::device cuda: no usable CUDA device (no GPU or no driver); use cpu");
  }
  const std::vector<int32_t> devices =
      options.devices.empty() ? std::vector<int32_t>{0} : options.devices;
  const int32_t n = static_cast<int32_t>(devices.size());
  if (options.shards > 1 && options.shards != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("EngineOptions::shards ", options.shards,
                     " on the cuda backend, which has one shard per "
                     "EngineOptions::devices entry (",
                     n, "); name a device once per shard, e.g. devices {0, 0}"));
  }
  for (int32_t d : devices) {
    if (d < 0 || d >= count) {
      return absl::FailedPreconditionError(absl::StrCat("EngineOptions::devices: CUDA device ", d,
                                                        " does not exist; this host has ", count,
                                                        " usable device(s), 0 to ", count - 1));
    }
  }
  ATTND_ASSIGN_OR_RETURN(const DcaGeometry shard_geometry, ShardGeometry(options.geometry, n));
  int64_t num_pages = 0;
  if (options.kv_cache_bytes > 0) {  // the pool of all shards together
    ATTND_ASSIGN_OR_RETURN(const KvLayout full,
                           LayoutFor(options, options.geometry, *kv_dtype, options.kv_cache_bytes));
    num_pages = full.num_pages;
  } else {
    if (!(options.kv_cache_fraction > 0 && options.kv_cache_fraction <= 0.98)) {
      return absl::InvalidArgumentError(
          absl::StrCat("EngineOptions::kv_cache_fraction must be in (0, 0.98], got ",
                       options.kv_cache_fraction));
    }
    // Each device's fraction of free memory is split among its shards; every shard holds every
    // page, so the device with the least room per shard sets the page count. The engines' own
    // staging and workspace buffers come out of the remainder.
    // An int8 or fp8 engine also keeps a bf16 copy of one layer of the longest sequence for its
    // prefill kernels (CudaEngine's prefill scratch, 4 bytes a token per kv head and head_dim
    // element pair, K and V): the fraction covers pool and scratch together, split by their bytes a
    // token.
    double pool_share = 1.0;
    if (HasRowScale(*kv_dtype)) {
      const double pool_token =
          static_cast<double>(KvLayout{options.num_layers, shard_geometry.num_kv_heads,
                                       shard_geometry.head_dim, options.page_size, *kv_dtype, 0}
                                  .bytes_per_token());
      const double scratch_token = 4.0 * shard_geometry.num_kv_heads * shard_geometry.head_dim;
      pool_share = pool_token / (pool_token + scratch_token);
    }
    for (int32_t d : devices) {
      ATTND_ASSIGN_OR_RETURN(const int64_t free_bytes, CudaFreeMemoryBytes(d));
      const int64_t on_device = std::count(devices.begin(), devices.end(), d);
      const int64_t room = static_cast<int64_t>(static_cast<double>(free_bytes) *
                                                options.kv_cache_fraction * pool_share) /
                           on_device;
      ATTND_ASSIGN_OR_RETURN(const KvLayout shard,
                             LayoutFor(options, shard_geometry, *kv_dtype, room));
      num_pages = num_pages == 0 ? shard.num_pages : std::min(num_pages, shard.num_pages);
    }
  }
  ATTND_ASSIGN_OR_RETURN(std::vector<ShardPlan> plans,
                         PlanShards(options, n, *kv_dtype, num_pages));
  std::vector<std::unique_ptr<Engine>> shards;
  for (int32_t i = 0; i < n; ++i) {
    CudaEngineOptions cuda;
    cuda.geometry = plans[i].geometry;
    cuda.layout = plans[i].layout;
    cuda.device = devices[i];
    cuda.max_decode_batch = options.max_decode_batch;
    cuda.graph_batch_sizes = options.cuda_graph_batch_sizes;
    cuda.cuda_graphs = options.cuda_graphs;
    cuda.sparse = plans[i].sparse;
    if (options.prefill_step_keys > 0) cuda.prefill_step_keys = options.prefill_step_keys;
    cuda.decode_reserved_sms = options.decode_reserved_sms;
    ATTND_ASSIGN_OR_RETURN(std::unique_ptr<Engine> shard, CreateCudaEngine(cuda));
    shards.push_back(std::move(shard));
  }
  return CreateShardedEngine(options.geometry, std::move(shards));
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCpu(const EngineOptions& options) {
  if (!options.devices.empty()) {
    return absl::InvalidArgumentError(
        "EngineOptions::devices names CUDA devices; the cpu backend shards with "
        "EngineOptions::shards");
  }
  absl::StatusOr<DType> kv_dtype = ResolveKvDType(options.kv_dtype, "cpu");
  if (!kv_dtype.ok()) return kv_dtype.status();
  const int32_t n = std::max(1, options.shards);
  const int64_t pool_bytes =
      options.kv_cache_bytes > 0 ? options.kv_cache_bytes : DefaultCpuPoolBytes();
  ATTND_ASSIGN_OR_RETURN(const KvLayout full,
                         LayoutFor(options, options.geometry, *kv_dtype, pool_bytes));
  ATTND_ASSIGN_OR_RETURN(std::vector<ShardPlan> plans,
                         PlanShards(options, n, *kv_dtype, full.num_pages));
  const int threads = options.compute_threads > 0
                          ? options.compute_threads
                          : static_cast<int>(std::thread::hardware_concurrency());
  std::vector<std::unique_ptr<Engine>> shards;
  for (int32_t i = 0; i < n; ++i) {
    CpuEngineOptions cpu;
    cpu.geometry = plans[i].geometry;
    cpu.layout = plans[i].layout;
    // One shard keeps the requested count (0: all cores); shards share the cores.
    cpu.compute_threads = n == 1 ? options.compute_threads : std::max(1, threads / n);
    cpu.sparse = plans[i].sparse;
    if (options.prefill_step_keys > 0) cpu.prefill_step_keys = options.prefill_step_keys;
    ATTND_ASSIGN_OR_RETURN(std::unique_ptr<CpuEngine> shard, CpuEngine::Create(cpu));
    shards.push_back(std::move(shard));
  }
  return CreateShardedEngine(options.geometry, std::move(shards));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const EngineOptions& options) {
  if (options.device != "cpu" && options.device != "auto" && options.device != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat(
        "EngineOptions::device must be auto, cpu or cuda, got \"", options.device, "\""));
  }
  if (options.kv_cache_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("EngineOptions::kv_cache_bytes must be >= 0, got ", options.kv_cache_bytes));
  }
  if (options.shards < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("EngineOptions::shards must be >= 1, got ", options.shards));
  }
  if (options.device == "cuda" || (options.device == "auto" && CudaDeviceCount() > 0)) {
    return CreateCuda(options);
  }
  return CreateCpu(options);
}

}  // namespace attnd
