// Picks and builds the backend named by --device. Keeps backend choice in one place so the server
// and tests never name a concrete engine.
#ifndef ATTND_SERVER_ENGINE_ENGINE_FACTORY_H_
#define ATTND_SERVER_ENGINE_ENGINE_FACTORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "kernels/dca.h"
#include "server/config/sparse_config.h"
#include "server/engine/engine.h"

namespace attnd {

struct EngineOptions {
  std::string device = "auto";  // auto | cpu | cuda
  // cuda: the CUDA devices (ordinals) to shard the kv heads over, one shard each, in head order;
  // an ordinal may repeat (two shards on one GPU). Empty: device 0 alone.
  std::vector<int32_t> devices;
  // cpu: shards of the kv heads (0 or 1: unsharded); each gets compute_threads / shards threads.
  // cuda: 0, or the number of devices.
  int32_t shards = 0;
  DcaGeometry geometry;
  int32_t num_layers = 0;
  int32_t page_size = 16;
  std::string kv_dtype = "auto";  // auto | bf16 | fp32 | fp8 | int8 (fp8: the cpu backend only)
  int64_t kv_cache_bytes = 0;     // 0 = the backend's default; all shards together
  // cuda, when kv_cache_bytes is 0: this fraction of the device's free memory (like vLLM's
  // gpu_memory_utilization, but of what is free at start-up).
  double kv_cache_fraction = 0.9;
  int32_t compute_threads = 0;  // 0 = all cores
  // Vertical-slash sparse prefill budgets (ModelConfig::sparse), or null. Both backends run the
  // sparse path for prompts over the threshold.
  std::shared_ptr<const SparseAttentionConfig> sparse;
  // cuda: decode batches of up to this many entries, padded to the next captured size (a CUDA graph
  // per size and layer, captured at creation unless cuda_graphs is false). Ignored by the CPU.
  int32_t max_decode_batch = 256;
  std::vector<int32_t> cuda_graph_batch_sizes = DefaultDecodeBatchSizes();
  bool cuda_graphs = true;
  // The bound on one prefill step's work (Engine::StartPrefill), in keys per query row of a
  // 128-row tile: a decode waits for at most one such step (--prefill-step-keys). 0: the
  // backend's default (CudaEngineOptions, CpuEngineOptions).
  int64_t prefill_step_keys = 0;
  // cuda: SMs kept free of prefill for decode (CudaEngineOptions::decode_reserved_sms,
  // --decode-reserved-sms). Ignored by the CPU.
  int32_t decode_reserved_sms = 0;
};

// "0,1" (CUDA ordinals, repeats allowed) as a list; INVALID_ARGUMENT naming --devices otherwise.
absl::StatusOr<std::vector<int32_t>> ParseDeviceList(absl::string_view text);

// The KV dtype for `kv_dtype` on `backend` ("cpu": auto means fp32, exact against fp32 references).
absl::StatusOr<DType> ResolveKvDType(const std::string& kv_dtype, const std::string& backend);

// cpu builds a CpuEngine, cuda a CUDA engine (FAILED_PRECONDITION without a usable GPU), auto the
// CUDA engine when a GPU is present and the CPU engine otherwise; several shards make a sharded
// engine over them (server/engine/sharded_engine.h), every shard with the same pages. Errors name
// the option that was wrong.
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const EngineOptions& options);

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_ENGINE_FACTORY_H_
