// A fixed pool of worker threads for the CPU kernels' data-parallel loops.
#ifndef ATTND_BASE_THREAD_POOL_H_
#define ATTND_BASE_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

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

  // std::mutex rather than absl::Mutex: Debian's abseil is not built with ThreadSanitizer, so
  // TSan cannot see absl::Mutex's happens-before edges and would report every kernel's inputs
  // and outputs handed across this pool as races. pthread mutexes it does see.
  std::mutex mu_;
  std::condition_variable work_cv_;  // a job was queued, or stopping_
  std::condition_variable done_cv_;  // some Job::active dropped to 0
  // Guarded by mu_ (no ABSL_GUARDED_BY: libstdc++'s std::mutex is not an annotated capability).
  std::vector<Job*> queue_;  // jobs that may still have indices to claim
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace attnd

#endif  // ATTND_BASE_THREAD_POOL_H_
