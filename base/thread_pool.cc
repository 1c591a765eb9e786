#include "base/thread_pool.h"

#include <algorithm>
#include <atomic>

namespace attnd {

// One ParallelFor call. Lives on the caller's stack; workers only touch it between taking it from
// the queue (active++) and giving it back (active--), both under the pool mutex, and the caller
// waits for active == 0 after unlisting it, so it never dangles.
struct ThreadPool::Job {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t n = 0;
  std::atomic<int64_t> next{0};  // next index to claim
  int active = 0;                // workers inside RunJob; guarded by the pool's mu_
};

namespace {

// Claims indices one at a time until none are left: dynamic scheduling, so uneven items (causal
// attention rows) balance across threads.
void RunJob(const std::function<void(int64_t)>& fn, int64_t n, std::atomic<int64_t>* next) {
  for (int64_t i = next->fetch_add(1, std::memory_order_relaxed); i < n;
       i = next->fetch_add(1, std::memory_order_relaxed)) {
    fn(i);
  }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (num_threads <= 0) num_threads = 1;
  // The calling thread of ParallelFor works too, so num_threads - 1 workers keep num_threads
  // cores busy. num_threads() still reports the parallelism the caller asked for.
  workers_.reserve(num_threads);
  for (int i = 0; i < num_threads - 1; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping_ and nothing left to help with.
    Job* job = queue_.front();
    ++job->active;
    lock.unlock();
    RunJob(*job->fn, job->n, &job->next);
    lock.lock();
    // The job is exhausted: unlist it so idle workers stop picking it up.
    auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it != queue_.end()) queue_.erase(it);
    if (--job->active == 0) done_cv_.notify_all();
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Job job;
  job.fn = &fn;
  job.n = n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(&job);
  }
  work_cv_.notify_all();
  // The caller works as well; this also makes nested ParallelFor calls from inside fn safe.
  RunJob(fn, n, &job.next);
  std::unique_lock<std::mutex> lock(mu_);
  auto it = std::find(queue_.begin(), queue_.end(), &job);
  if (it != queue_.end()) queue_.erase(it);
  // Every index is claimed; wait for the workers still running theirs.
  done_cv_.wait(lock, [&job] { return job.active == 0; });
}

}  // namespace attnd
