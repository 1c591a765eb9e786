// A fixed pool of worker threads for the CPU kernels' data-parallel loops.
#ifndef ATTND_KERNELS_THREAD_POOL_H_
#define ATTND_KERNELS_THREAD_POOL_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace attnd {

// Thread-safe: any thread may call ParallelFor; concurrent calls share the workers.
class ThreadPool {
 public:
  // num_threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads that run ParallelFor work: the workers plus the calling thread.
  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) for every i in [0, n), spread over the workers and the calling thread; returns when
  // all calls have returned. fn must not throw.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  struct Job;
  void WorkerLoop();

  absl::Mutex mu_;
  std::vector<Job*> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace attnd

#endif  // ATTND_KERNELS_THREAD_POOL_H_
