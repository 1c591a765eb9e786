// The CPU backend: the KV pool is one aligned host allocation laid out as kvcache/kv_layout.h says,
// and attention runs on the exact fp32 kernels of kernels/dca_cpu.h over a private thread pool.
// K/V are stored as fp32, bf16, fp8 E4M3 or int8 (the last two with a scale per token and kv head,
// base/fp8.h, base/int8_kv.h: quantised on append, dequantised wherever the kernels read them).
#ifndef ATTND_SERVER_ENGINE_CPU_ENGINE_H_
#define ATTND_SERVER_ENGINE_CPU_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/thread_pool.h"
#include "kernels/dca.h"
#include "kernels/paged_kv.h"
#include "kvcache/kv_layout.h"
#include "server/config/sparse_config.h"
#include "server/engine/engine.h"

namespace attnd {

struct CpuEngineOptions {
  DcaGeometry geometry;
  KvLayout layout;              // kv_dtype must be kFp32, kBf16, kFp8E4m3 or kInt8
  int32_t compute_threads = 0;  // 0 = all cores
  // Vertical-slash sparse prefill (kernels/sparse_prefill_cpu.h) for prompts longer than its
  // threshold when set and enabled; its layers and q heads must match the layout and geometry.
  std::shared_ptr<const SparseAttentionConfig> sparse;
  // A dense prefill step attends about this many keys per query row of a 128-row tile
  // (Engine::StartPrefill): rows per step = max(1, 128 * this / (start + tokens)). The CPU is about
  // a thousand times slower than an H200 at attention, so its default is far below CUDA's: a step
  // of the 7B geometry is then ~1 GFLOP, tens of milliseconds on a few cores.
  int64_t prefill_step_keys = 512;
};

// min(4 GiB, a quarter of physical memory): a default that leaves room for the rest of the host.
int64_t DefaultCpuPoolBytes();

// Thread-safe for jobs on disjoint sequences, as Engine requires. Concurrent jobs share the
// compute pool.
class CpuEngine : public Engine {
 public:
  // INVALID_ARGUMENT for an inconsistent geometry/layout or an unsupported KV dtype;
  // RESOURCE_EXHAUSTED when the pool cannot be allocated.
  static absl::StatusOr<std::unique_ptr<CpuEngine>> Create(const CpuEngineOptions& options);
  ~CpuEngine() override;

  std::string backend() const override { return "cpu"; }
  std::string device_name() const override { return device_name_; }
  const KvLayout& layout() const override { return layout_; }
  const DcaGeometry& geometry() const override { return geometry_; }

  absl::Status Prefill(const PrefillJob& job) override;
  absl::StatusOr<std::unique_ptr<PrefillRun>> StartPrefill(const PrefillJob& job) override;
  absl::StatusOr<DecodeStats> Decode(const DecodeJob& job) override;
  // Decode and prefill share the compute pool, which interleaves their work finely: measured
  // beside a prefill stream, a decode waited far less this way than for whole steps to end, and
  // no longer than with one engine lock (docs/BENCHMARKS.md, "Decode beside prefill on the CPU
  // backend").
  bool overlaps_prefill_and_decode() const override { return true; }

 private:
  template <typename KvT>
  class Run;

  CpuEngine(const CpuEngineOptions& options, void* pool);

  template <typename KvT>
  PagedKv<KvT> LayerView(int32_t layer, const int32_t* page_table) const;
  // OK for kVariants, and for kPreRotary when the geometry has a rotary.
  absl::Status CheckLayout(QLayout layout) const;
  absl::Status CheckPages(int32_t layer, const int32_t* page_table, int64_t num_pages,
                          int64_t length) const;
  template <typename KvT>
  absl::StatusOr<std::unique_ptr<PrefillRun>> StartTyped(const PrefillJob& job) const;
  template <typename KvT>
  absl::Status DecodeTyped(const DecodeJob& job);

  const DcaGeometry geometry_;
  const KvLayout layout_;
  const std::shared_ptr<const SparseAttentionConfig> sparse_;  // may be null
  // RotaryInvFreq of the geometry; empty when it has no usable rotary (pre-rotary jobs refused).
  const std::vector<float> inv_freq_;
  const std::string device_name_;
  char* const pool_;  // layout_.pool_bytes() bytes, 64-byte aligned; owned
  const int64_t prefill_step_keys_;
  std::unique_ptr<ThreadPool> compute_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_CPU_ENGINE_H_
