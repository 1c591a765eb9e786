// Tests only: an Engine that forwards everything to the engine it wraps, and calls `before_step`
// (which may sleep or return an error instead of running the step) before every step of every
// prefill run it starts. What a slow device or a device error half-way through a call looks like.
#ifndef ATTND_SERVER_ENGINE_PREFILL_STEP_HOOK_FOR_TESTING_H_
#define ATTND_SERVER_ENGINE_PREFILL_STEP_HOOK_FOR_TESTING_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/engine/engine.h"

namespace attnd {

class PrefillStepHook : public Engine {
 public:
  PrefillStepHook(std::unique_ptr<Engine> inner, std::function<absl::Status()> before_step)
      : inner_(std::move(inner)), before_step_(std::move(before_step)) {}

  std::string backend() const override { return inner_->backend(); }
  std::string device_name() const override { return inner_->device_name(); }
  const KvLayout& layout() const override { return inner_->layout(); }
  const DcaGeometry& geometry() const override { return inner_->geometry(); }
  absl::Status Prefill(const PrefillJob& job) override { return inner_->Prefill(job); }
  absl::StatusOr<DecodeStats> Decode(const DecodeJob& job) override { return inner_->Decode(job); }
  absl::StatusOr<std::unique_ptr<PrefillRun>> StartPrefill(const PrefillJob& job) override {
    absl::StatusOr<std::unique_ptr<PrefillRun>> run = inner_->StartPrefill(job);
    if (!run.ok()) return run.status();
    return std::unique_ptr<PrefillRun>(new Run(*std::move(run), &before_step_));
  }

 private:
  class Run : public PrefillRun {
   public:
    Run(std::unique_ptr<PrefillRun> inner, const std::function<absl::Status()>* before_step)
        : inner_(std::move(inner)), before_step_(before_step) {}
    bool done() const override { return failed_ || inner_->done(); }
    absl::Status Step() override {
      if (absl::Status s = (*before_step_)(); !s.ok()) {
        failed_ = true;
        return s;
      }
      return inner_->Step();
    }

   private:
    const std::unique_ptr<PrefillRun> inner_;
    const std::function<absl::Status()>* const before_step_;
    bool failed_ = false;
  };

  const std::unique_ptr<Engine> inner_;
  const std::function<absl::Status()> before_step_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_PREFILL_STEP_HOOK_FOR_TESTING_H_
