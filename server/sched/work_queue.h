// The seam between the gRPC front end and the engine: gRPC threads never compute, they hand each
// request to a WorkQueue (a bounded FIFO of closures run by a fixed set of worker threads) and
// return. Decode requests reach it through server/sched/decode_queue.h.
#ifndef ATTND_SERVER_SCHED_WORK_QUEUE_H_
#define ATTND_SERVER_SCHED_WORK_QUEUE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "base/mutex.h"
#include "server/sched/request_context.h"

namespace attnd {

struct WorkQueueOptions {
  int32_t num_workers = 0;  // 0 = DefaultRequestWorkers()
  int64_t capacity = 4096;  // most closures waiting (not counting running ones)
};

// 2 x cores, at least 4: requests mostly wait on the compute pool or on a sequence lock, so more
// workers than cores keep independent sequences moving.
int32_t DefaultRequestWorkers();

// Thread-safe. Closures run in submission order (FIFO), each on one worker thread.
class WorkQueue {
 public:
  explicit WorkQueue(const WorkQueueOptions& options);
  // Stops accepting, runs what is queued, joins the workers.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues fn. UNAVAILABLE once StopAccepting has been called; RESOURCE_EXHAUSTED when `capacity`
  // closures are already waiting. fn is not run (and is destroyed) when Submit fails.
  absl::Status Submit(std::function<void()> fn);
  // Queues a request's work with its context: the worker that dequeues it calls
  // fn(AdmitAt(context, now)) (server/sched/request_context.h), and fn answers a non-OK status (the
  // deadline passed or the call was cancelled while it waited) without running the request.
  // Refusals as above; fn is not run when Submit fails.
  absl::Status Submit(const RequestContext& context, std::function<void(absl::Status)> fn);

  // Later Submit calls fail with UNAVAILABLE; queued closures still run (their RPCs must finish).
  void StopAccepting();
  // StopAccepting, then waits until every queued closure has run and the workers have exited.
  void Shutdown();

  int32_t num_workers() const { return static_cast<int32_t>(workers_.size()); }
  int64_t num_waiting() const;

 private:
  void WorkerLoop();
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t capacity_;
  mutable Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  CondVar work_cv_;  // signalled once per queued closure; all at shutdown
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // workers exit once the queue is empty
  Mutex join_mu_;                               // serialises Shutdown callers
  std::vector<std::thread> workers_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_SCHED_WORK_QUEUE_H_
