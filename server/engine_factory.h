// Picks and builds the backend named by --device. Keeps backend choice in one place so the server
// and tests never name a concrete engine.
#ifndef ATTND_SERVER_ENGINE_FACTORY_H_
#define ATTND_SERVER_ENGINE_FACTORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/dca.h"
#include "kernels/dtype.h"
#include "server/engine.h"

namespace attnd {

struct EngineOptions {
  std::string device = "auto";  // auto | cpu | cuda
  DcaGeometry geometry;
  int32_t num_layers = 0;
  int32_t page_size = 16;
  std::string kv_dtype = "auto";  // auto | bf16 | fp32
  int64_t kv_cache_bytes = 0;     // 0 = the backend's default
  int32_t compute_threads = 0;    // 0 = all cores
};

// The KV dtype for `kv_dtype` on `backend` ("cpu": auto means fp32, exact against fp32 references).
absl::StatusOr<DType> ResolveKvDType(const std::string& kv_dtype, const std::string& backend);

// cpu and auto build a CpuEngine; cuda fails with FAILED_PRECONDITION until that backend exists.
// Errors name the option that was wrong.
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const EngineOptions& options);

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_FACTORY_H_
