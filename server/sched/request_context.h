// One request's context as it waits to run: its deadline, its cancellation and when it was
// queued. Plain data, no protobuf or gRPC: the RPC front end (server/rpc/service.cc) fills it, it
// travels with the call through the work queue (server/sched/work_queue.h) and the decode queues
// (server/sched/decode_queue.h, server/sched/batcher.h), and whoever dequeues the call checks it
// (AdmitAt) before the call touches anything, answering DEADLINE_EXCEEDED / CANCELLED without
// running it.
#ifndef ATTND_SERVER_SCHED_REQUEST_CONTEXT_H_
#define ATTND_SERVER_SCHED_REQUEST_CONTEXT_H_

#include <atomic>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace attnd {

// Told when a call leaves its queue, for metrics (queue wait = started - enqueue_time). Called on
// the dequeuing thread, once per AdmitAt, before the call's answer is given.
class RequestObserver {
 public:
  virtual ~RequestObserver() = default;
  virtual void OnStarted(absl::Time started) = 0;
};

struct RequestContext {
  // The client's deadline; InfiniteFuture: none.
  absl::Time deadline = absl::InfiniteFuture();
  // Set (to true, once) by whoever learns of the cancellation (the gRPC reactor's OnCancel); read
  // by whoever dequeues the call. Null: never cancelled.
  std::shared_ptr<const std::atomic<bool>> cancelled;
  // When the front end received the call; InfinitePast: unknown (the wait is then not named).
  absl::Time enqueue_time = absl::InfinitePast();
  // Unowned, may be null; must outlive the call's answer.
  RequestObserver* observer = nullptr;
  // The submitting thread only waits for this call's answer (a ring's thread): a decode batch
  // that its Submit launches runs right there instead of waking a worker (tens of microseconds on
  // a VM). Work that batch starts in turn goes to the workers.
  bool run_on_caller = false;
  // The submitter has more calls right behind this one (a ring's micro-batches, posted together):
  // the batcher queues it without launching anything, so that the next call's Submit launches
  // them as one batch where they fit; if none comes, the timer launches it a moment later.
  bool more_follow = false;

  bool IsCancelled() const {
    return cancelled != nullptr && cancelled->load(std::memory_order_acquire);
  }
};

// A fresh cancel flag for RequestContext::cancelled (the setter keeps the non-const pointer).
inline std::shared_ptr<std::atomic<bool>> NewCancelFlag() {
  return std::make_shared<std::atomic<bool>>(false);
}

// What whoever dequeues a call does first, at `now`: tells the observer the call started, then
// says whether it may run. DEADLINE_EXCEEDED once the deadline is reached (naming how long the
// call waited), CANCELLED once the flag is set; nothing was done in either case.
inline absl::Status AdmitAt(const RequestContext& context, absl::Time now) {
  if (context.observer != nullptr) context.observer->OnStarted(now);
  if (context.deadline <= now) {
    const absl::Duration waited =
        context.enqueue_time == absl::InfinitePast()
            ? absl::ZeroDuration()
            : absl::Trunc(now - context.enqueue_time, absl::Milliseconds(1));
    return absl::DeadlineExceededError(
        absl::StrCat("the client's deadline passed while the request waited ",
                     absl::FormatDuration(waited), " in the queue; nothing was done"));
  }
  if (context.IsCancelled()) {
    return absl::CancelledError("the call was cancelled before it started; nothing was done");
  }
  return absl::OkStatus();
}

}  // namespace attnd

#endif  // ATTND_SERVER_SCHED_REQUEST_CONTEXT_H_
