#include "server/engine/fault_engine.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnd {

FaultEngine::FaultEngine(std::unique_ptr<Engine> inner) : inner_(std::move(inner)) {}

absl::Status FaultEngine::Inject(const char* what, int32_t layer, std::atomic<int64_t>* budget) {
  if (lost_.load()) {
    injected_.fetch_add(1);
    return absl::InternalError(absl::StrCat("injected fault: the device is lost (", what, ")"));
  }
  if (layer == failing_layer_.load()) {
    injected_.fetch_add(1);
    return absl::InternalError(absl::StrCat("injected fault: ", what, " on layer ", layer));
  }
  int64_t left = budget->load();
  while (left > 0) {
    if (budget->compare_exchange_weak(left, left - 1)) {
      injected_.fetch_add(1);
      return absl::InternalError(absl::StrCat("injected fault: ", what, " failed"));
    }
  }
  return absl::OkStatus();
}

void FaultEngine::HoldPrefills() {
  MutexLock lock(&gate_mu_);
  holding_ = true;
}

void FaultEngine::ReleasePrefills() {
  MutexLock lock(&gate_mu_);
  holding_ = false;
}

int64_t FaultEngine::held_prefills() const {
  MutexLock lock(&gate_mu_);
  return waiting_;
}

absl::Status FaultEngine::Prefill(const PrefillJob& job) {
  {
    MutexLock lock(&gate_mu_);
    ++waiting_;
    gate_mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_mu_) { return !holding_; });
    --waiting_;
  }
  if (absl::Status s = Inject("prefill", job.layer, &prefill_failures_); !s.ok()) return s;
  prefills_.fetch_add(1);
  return inner_->Prefill(job);
}

absl::StatusOr<DecodeStats> FaultEngine::Decode(const DecodeJob& job) {
  if (absl::Status s = Inject("decode", job.layer, &decode_failures_); !s.ok()) return s;
  decodes_.fetch_add(1);
  return inner_->Decode(job);
}

}  // namespace attnd
