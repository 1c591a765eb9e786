// Where the service sends decode requests. An interface so a cross-RPC batcher (which merges
// decodes of one layer from many RPCs into one engine batch) can replace the direct implementation
// without touching the service.
#ifndef ATTND_SERVER_SCHED_DECODE_QUEUE_H_
#define ATTND_SERVER_SCHED_DECODE_QUEUE_H_

#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/runtime/runtime.h"
#include "server/sched/request_context.h"
#include "server/sched/work_queue.h"

namespace attnd {

// Where the service sends decode requests. `done` is called exactly once, on a worker thread, when
// Submit returned OK; the call's tensors must stay valid until then. When Submit fails, done is
// never called.
//
// `context` (server/sched/request_context.h) is the RPC's deadline and cancellation: whoever
// dequeues the call checks it (AdmitAt) just before the call runs, and a batcher also answers a
// call that expires or is cancelled while it waits for its batch, without running it.
class DecodeQueue {
 public:
  using Done = std::function<void(absl::StatusOr<DecodeResult>)>;
  virtual ~DecodeQueue() = default;
  absl::Status Submit(DecodeCall call, Done done) {
    return Submit(std::move(call), RequestContext(), std::move(done));
  }
  virtual absl::Status Submit(DecodeCall call, const RequestContext& context, Done done) = 0;
};

// Runs each decode request on its own as one batch on the work queue (no cross-RPC batching).
class DirectDecodeQueue : public DecodeQueue {
 public:
  DirectDecodeQueue(Runtime* runtime, WorkQueue* work_queue)
      : runtime_(runtime), work_queue_(work_queue) {}
  using DecodeQueue::Submit;
  // The call waits only in the work queue: the worker that picks it up checks the context.
  absl::Status Submit(DecodeCall call, const RequestContext& context, Done done) override;

 private:
  Runtime* const runtime_;
  WorkQueue* const work_queue_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_SCHED_DECODE_QUEUE_H_
