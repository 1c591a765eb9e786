#include "server/sched/work_queue.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnd {

int32_t DefaultRequestWorkers() {
  const int32_t cores = static_cast<int32_t>(std::thread::hardware_concurrency());
  return std::max<int32_t>(4, 2 * cores);
}

WorkQueue::WorkQueue(const WorkQueueOptions& options)
    : capacity_(options.capacity > 0 ? options.capacity : 1) {
  const int32_t n = options.num_workers > 0 ? options.num_workers : DefaultRequestWorkers();
  workers_.reserve(n);
  for (int32_t i = 0; i < n; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

WorkQueue::~WorkQueue() { Shutdown(); }

absl::Status WorkQueue::Submit(std::function<void()> fn) {
  MutexLock lock(&mu_);
  if (!accepting_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int64_t>(queue_.size()) >= capacity_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the request queue is full (", capacity_, " requests waiting); retry later"));
  }
  queue_.push_back(std::move(fn));
  // One closure, one worker: notify_one, not Await's wake-everyone (with 2 x cores workers idle,
  // every Submit used to wake them all, and each wake is a context switch).
  work_cv_.Signal();
  return absl::OkStatus();
}

absl::Status WorkQueue::Submit(const RequestContext& context,
                               std::function<void(absl::Status)> fn) {
  return Submit([context, fn = std::move(fn)] { fn(AdmitAt(context, absl::Now())); });
}

void WorkQueue::StopAccepting() {
  MutexLock lock(&mu_);
  accepting_ = false;
}

void WorkQueue::Shutdown() {
  MutexLock join_lock(&join_mu_);
  {
    MutexLock lock(&mu_);
    accepting_ = false;
    stopping_ = true;
    work_cv_.SignalAll();
  }
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

int64_t WorkQueue::num_waiting() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

bool WorkQueue::HasWorkOrStopping() const { return !queue_.empty() || stopping_; }

void WorkQueue::WorkerLoop() {
  for (;;) {
    std::function<void()> fn;
    {
      MutexLock lock(&mu_);
      while (!HasWorkOrStopping()) work_cv_.Wait(&mu_);
      // Drain before exiting: a queued closure owns an RPC that must be answered.
      if (queue_.empty()) return;
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

}  // namespace attnd
