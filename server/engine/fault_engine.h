// Tests only: an Engine decorator that fails on command (tests/reliability). It forwards to the
// engine it wraps until told to fail: the next N prefills/decodes, every job on one layer, or
// everything from now on because the device is "lost" (then healthy() is false and the server
// turns its health NOT_SERVING). A failed job returns INTERNAL and never reaches the wrapped
// engine, so it writes nothing. Thread-safe.
#ifndef ATTND_SERVER_ENGINE_FAULT_ENGINE_H_
#define ATTND_SERVER_ENGINE_FAULT_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "base/mutex.h"
#include "server/engine/engine.h"

namespace attnd {

class FaultEngine : public Engine {
 public:
  explicit FaultEngine(std::unique_ptr<Engine> inner);

  void FailNextPrefills(int64_t n) { prefill_failures_.store(n); }
  void FailNextDecodes(int64_t n) { decode_failures_.store(n); }
  void FailLayer(int32_t layer) { failing_layer_.store(layer); }  // -1: none
  void LoseDevice() { lost_.store(true); }
  // Prefills wait inside the engine (holding their request worker) until ReleasePrefills(): a
  // "slow" job whose length the test decides, instead of a timing guess.
  void HoldPrefills();
  void ReleasePrefills();
  int64_t held_prefills() const;  // prefills waiting at the gate now

  int64_t injected_failures() const { return injected_.load(); }
  int64_t prefills() const { return prefills_.load(); }  // jobs forwarded to the wrapped engine
  int64_t decodes() const { return decodes_.load(); }

  std::string backend() const override { return inner_->backend(); }
  std::string device_name() const override { return inner_->device_name(); }
  std::string device() const override { return inner_->device(); }
  const KvLayout& layout() const override { return inner_->layout(); }
  const DcaGeometry& geometry() const override { return inner_->geometry(); }
  absl::Status Prefill(const PrefillJob& job) override;
  absl::StatusOr<DecodeStats> Decode(const DecodeJob& job) override;
  std::vector<int32_t> decode_batch_sizes() const override { return inner_->decode_batch_sizes(); }
  bool decode_graphs() const override { return inner_->decode_graphs(); }
  bool healthy() const override { return !lost_.load() && inner_->healthy(); }

 private:
  // INTERNAL if this job is to fail (and counts it), else OK.
  absl::Status Inject(const char* what, int32_t layer, std::atomic<int64_t>* budget);

  const std::unique_ptr<Engine> inner_;
  mutable Mutex gate_mu_;
  bool holding_ ABSL_GUARDED_BY(gate_mu_) = false;
  int64_t waiting_ ABSL_GUARDED_BY(gate_mu_) = 0;
  std::atomic<int64_t> prefill_failures_{0};
  std::atomic<int64_t> decode_failures_{0};
  std::atomic<int32_t> failing_layer_{-1};
  std::atomic<bool> lost_{false};
  std::atomic<int64_t> injected_{0};
  std::atomic<int64_t> prefills_{0};
  std::atomic<int64_t> decodes_{0};
};

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_FAULT_ENGINE_H_
