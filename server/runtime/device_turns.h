// Who uses the device next. The runtime asks for a turn before every device step, a decode batch
// or one step of a prefill call (Engine::StartPrefill), and gives it back when the step is done;
// the scheduler behind this seam (server/sched/step_scheduler.h) decides the order. It sits here,
// below the scheduler, so that every path into the engine (unary calls, Sessions, rings, the wire
// prefill) takes turns without knowing who hands them out.
#ifndef ATTND_SERVER_RUNTIME_DEVICE_TURNS_H_
#define ATTND_SERVER_RUNTIME_DEVICE_TURNS_H_

namespace attnd {

enum class DeviceWork { kDecode, kPrefill };

// Thread-safe.
class DeviceTurns {
 public:
  virtual ~DeviceTurns() = default;
  // Blocks until a step of `work` may run.
  virtual void Acquire(DeviceWork work) = 0;
  // The step that Acquire admitted is done.
  virtual void Release(DeviceWork work) = 0;
};

// One step's turn, held for its scope; a null DeviceTurns admits everything at once.
class DeviceTurn {
 public:
  DeviceTurn(DeviceTurns* turns, DeviceWork work) : turns_(turns), work_(work) {
    if (turns_ != nullptr) turns_->Acquire(work_);
  }
  ~DeviceTurn() {
    if (turns_ != nullptr) turns_->Release(work_);
  }
  DeviceTurn(const DeviceTurn&) = delete;
  DeviceTurn& operator=(const DeviceTurn&) = delete;

 private:
  DeviceTurns* const turns_;
  const DeviceWork work_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_RUNTIME_DEVICE_TURNS_H_
