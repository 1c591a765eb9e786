#include "server/engine/sharded_engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace attnd {

absl::StatusOr<DcaGeometry> ShardGeometry(const DcaGeometry& geometry, int32_t num_shards) {
  if (num_shards < 1 || geometry.num_kv_heads % num_shards != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        num_shards, " shards cannot split the model's ", geometry.num_kv_heads,
        " kv heads evenly: use a number of devices (or EngineOptions::shards) that divides ",
        geometry.num_kv_heads));
  }
  DcaGeometry shard = geometry;
  shard.num_kv_heads = geometry.num_kv_heads / num_shards;
  shard.num_q_heads = geometry.num_q_heads / num_shards;
  return shard;
}

std::shared_ptr<const SparseAttentionConfig> ShardSparse(const SparseAttentionConfig& sparse,
                                                         int32_t first_q_head,
                                                         int32_t num_q_heads) {
  auto shard = std::make_shared<SparseAttentionConfig>(sparse);
  shard->num_q_heads = num_q_heads;
  shard->budgets.clear();
  for (int32_t layer = 0; layer < sparse.num_layers; ++layer) {
    const absl::Span<const VsBudget> heads = sparse.layer(layer);
    shard->budgets.insert(shard->budgets.end(), heads.begin() + first_q_head,
                          heads.begin() + first_q_head + num_q_heads);
  }
  return shard;
}

namespace {

// Runs the shards of a job at once: shard 0 on the calling thread, the others on workers. Several
// callers may run jobs at once (jobs on disjoint sequences); the workers take their parts in
// order. A decode step is tens of microseconds, about what waking a sleeping thread costs, so a
// worker that finished a part spins for kSpin before it sleeps, and so does a caller waiting for
// its parts: back-to-back steps (a model's layers) never sleep. std::mutex, as
// base/thread_pool.h explains, so that TSan sees the hand-offs.
class FanOut {
 public:
  static constexpr auto kSpin = std::chrono::microseconds(100);

  explicit FanOut(int num_threads) {
    for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }
  ~FanOut() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  // Calls fn(i) for every i in [0, n); returns when all calls have returned.
  void Run(int n, const std::function<void(int)>& fn) {
    Call call;
    call.fn = &fn;
    call.remaining.store(n - 1, std::memory_order_relaxed);
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int i = 1; i < n; ++i) queue_.push_back({&call, i});
      queued_.fetch_add(n - 1, std::memory_order_release);
      wake = sleepers_ > 0;
    }
    if (wake) work_cv_.notify_all();
    fn(0);
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (call.remaining.load(std::memory_order_acquire) != 0 &&
           std::chrono::steady_clock::now() < until) {
    }
    std::unique_lock<std::mutex> lock(mu_);
    // Taking the lock also waits for the last worker to be done with `call` (it decrements and
    // notifies under the lock).
    call.waiting = true;
    call.done.wait(lock, [&call] { return call.remaining.load(std::memory_order_acquire) == 0; });
  }

 private:
  struct Call {
    const std::function<void(int)>* fn = nullptr;
    std::atomic<int> remaining{0};  // parts not yet returned
    bool waiting = false;           // guarded by mu_: the caller sleeps on done
    std::condition_variable done;
  };
  struct Part {
    Call* call;
    int index;
  };

  void WorkerLoop() {
    while (true) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (queued_.load(std::memory_order_acquire) == 0 &&
             std::chrono::steady_clock::now() < until) {
      }
      std::unique_lock<std::mutex> lock(mu_);
      while (queue_.empty() && !stopping_) {
        ++sleepers_;
        work_cv_.wait(lock);
        --sleepers_;
      }
      if (queue_.empty()) return;  // stopping, and nothing left
      const Part part = queue_.front();
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
      lock.unlock();
      (*part.call->fn)(part.index);
      lock.lock();
      if (part.call->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1 && part.call->waiting) {
        part.call->done.notify_one();
      }
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::deque<Part> queue_;      // guarded by mu_
  std::atomic<int> queued_{0};  // queue_.size(), for spinning without the lock
  int sleepers_ = 0;            // guarded by mu_: workers waiting on work_cv_
  bool stopping_ = false;       // guarded by mu_
  std::vector<std::thread> workers_;
};

// Jobs the workers can drive at once (the CUDA shards serialise their own jobs; the CPU shards
// run concurrent jobs on their compute pools).
constexpr int kWorkersPerShard = 4;

class ShardedEngine : public Engine {
 public:
  ShardedEngine(const DcaGeometry& geometry, const KvLayout& layout,
                std::vector<std::unique_ptr<Engine>> shards)
      : geometry_(geometry),
        layout_(layout),
        shards_(std::move(shards)),
        fan_out_(static_cast<int>(shards_.size() - 1) * kWorkersPerShard) {
    std::vector<std::string> names, devices;
    for (const auto& shard : shards_) {
      if (names.empty() || names.back() != shard->device_name()) {
        names.push_back(shard->device_name());
      }
      devices.push_back(shard->device());
    }
    device_name_ = absl::StrJoin(names, ", ");
    device_ = absl::StrJoin(devices, ",");
  }

  std::string backend() const override { return shards_[0]->backend(); }
  std::string device_name() const override { return device_name_; }
  std::string device() const override { return device_; }
  const KvLayout& layout() const override { return layout_; }
  const DcaGeometry& geometry() const override { return geometry_; }
  bool healthy() const override {
    for (const auto& shard : shards_) {
      if (!shard->healthy()) return false;
    }
    return true;
  }
  // CUDA IPC regions are opened on the first shard's device; shards on other devices of the host
  // read them through peer access (cudaIpcMemLazyEnablePeerAccess).
  std::string device_uuid() const override { return shards_[0]->device_uuid(); }
  bool cuda_mps() const override { return shards_[0]->cuda_mps(); }
  DeviceMemoryOpener* device_memory_opener() override { return shards_[0]->device_memory_opener(); }

  std::vector<EngineShard> shards() const override {
    std::vector<EngineShard> out;
    const int32_t kv_heads = geometry_.num_kv_heads / num_shards();
    const int32_t q_heads = geometry_.num_q_heads / num_shards();
    for (int32_t i = 0; i < num_shards(); ++i) {
      EngineShard s = shards_[i]->shards()[0];
      s.first_kv_head = i * kv_heads;
      s.first_q_head = i * q_heads;
      out.push_back(std::move(s));
    }
    return out;
  }

  absl::Status Prefill(const PrefillJob& job) override {
    ATTND_RETURN_IF_ERROR(CheckHeads("q", job.q, geometry_.num_q_heads));
    ATTND_RETURN_IF_ERROR(CheckHeads("k", job.k, geometry_.num_kv_heads));
    ATTND_RETURN_IF_ERROR(CheckHeads("v", job.v, geometry_.num_kv_heads));
    const int64_t head_out = int64_t{geometry_.head_dim} * ElementSize(job.out_dtype);
    return RunShards([&](int32_t i) {
      const int64_t q_heads = geometry_.num_q_heads / num_shards();
      const int64_t kv_heads = geometry_.num_kv_heads / num_shards();
      PrefillJob part = job;
      part.q = SliceHeads(job.q, i * q_heads, q_heads);
      part.k = SliceHeads(job.k, i * kv_heads, kv_heads);
      part.v = SliceHeads(job.v, i * kv_heads, kv_heads);
      part.out = static_cast<char*>(job.out) + i * q_heads * head_out;
      part.out_row_pitch =
          job.out_row_pitch != 0 ? job.out_row_pitch : geometry_.num_q_heads * head_out;
      return shards_[i]->Prefill(part);
    });
  }

  // Every shard plans the same batch sizes: the first shard's speak for all.
  std::vector<int32_t> decode_batch_sizes() const override {
    return shards_[0]->decode_batch_sizes();
  }
  bool decode_graphs() const override { return shards_[0]->decode_graphs(); }
  // A call runs as one step on every shard at once; decode may overlap it where every shard's
  // engine overlaps the two.
  bool overlaps_prefill_and_decode() const override {
    return std::all_of(shards_.begin(), shards_.end(),
                       [](const auto& shard) { return shard->overlaps_prefill_and_decode(); });
  }

  absl::StatusOr<DecodeStats> Decode(const DecodeJob& job) override {
    for (const DecodeJob::Entry& e : job.entries) {
      ATTND_RETURN_IF_ERROR(CheckHeads("q", e.q, geometry_.num_q_heads));
      ATTND_RETURN_IF_ERROR(CheckHeads("k", e.k, geometry_.num_kv_heads));
      ATTND_RETURN_IF_ERROR(CheckHeads("v", e.v, geometry_.num_kv_heads));
    }
    const int64_t q_heads = geometry_.num_q_heads / num_shards();
    const int64_t kv_heads = geometry_.num_kv_heads / num_shards();
    // Copies of the runtime's job (only it makes jobs), each cut to one shard's heads.
    std::vector<DecodeJob> parts(shards_.size(), job);
    for (int32_t i = 0; i < num_shards(); ++i) {
      for (DecodeJob::Entry& e : parts[i].entries) {
        e.q = SliceHeads(e.q, i * q_heads, q_heads);
        e.k = SliceHeads(e.k, i * kv_heads, kv_heads);
        e.v = SliceHeads(e.v, i * kv_heads, kv_heads);
        e.out = static_cast<char*>(e.out) +
                i * q_heads * int64_t{geometry_.head_dim} * ElementSize(e.out_dtype);
      }
    }
    // Engines that can start a decode and finish it later (CUDA) are all started from this
    // thread, then finished: their steps run at once on their streams without a hand-off to
    // another thread, which costs about as much as a small step. The others run on the fan-out.
    std::vector<DecodeStats> stats(shards_.size());
    {
      std::vector<std::unique_ptr<PendingDecode>> pending(shards_.size());
      bool split = true;
      for (int32_t i = 0; i < num_shards() && split; ++i) {
        absl::StatusOr<std::unique_ptr<PendingDecode>> started = shards_[i]->StartDecode(parts[i]);
        if (!started.ok()) return Named(i, started.status());  // started ones finish on the way
        split = *started != nullptr;
        pending[i] = *std::move(started);
      }
      if (split) {
        absl::Status status;
        for (int32_t i = 0; i < num_shards(); ++i) {
          absl::StatusOr<DecodeStats> s = pending[i]->Finish();
          if (s.ok()) {
            stats[i] = *s;
          } else if (status.ok()) {
            status = Named(i, s.status());
          }
        }
        if (!status.ok()) return status;
        return stats[0];  // the shards ran the same batches
      }
    }  // a shard cannot split this job: any that started have finished; run it whole
    ATTND_RETURN_IF_ERROR(RunShards([&](int32_t i) {
      absl::StatusOr<DecodeStats> s = shards_[i]->Decode(parts[i]);
      if (s.ok()) stats[i] = *s;
      return s.status();
    }));
    return stats[0];
  }

 private:
  int32_t num_shards() const { return static_cast<int32_t>(shards_.size()); }

  // The head dimension (second to last) of a request tensor must be the model's: it is split.
  static absl::Status CheckHeads(const char* name, const TensorView& view, int64_t heads) {
    if (view.shape.size() < 2 || view.shape[view.shape.size() - 2] != heads) {
      return absl::InvalidArgumentError(absl::StrCat("engine: ", name, " must have ", heads,
                                                     " heads in its second-to-last dimension"));
    }
    return absl::OkStatus();
  }

  // `s` of shard i, its message prefixed with the shard.
  absl::Status Named(int32_t i, const absl::Status& s) const {
    return absl::Status(s.code(),
                        absl::StrCat("shard ", i, " (", shards_[i]->device(), "): ", s.message()));
  }

  // Runs part(i) for every shard at once; the first failing shard's status, naming it.
  absl::Status RunShards(const std::function<absl::Status(int32_t)>& part) {
    std::vector<absl::Status> status(shards_.size());
    fan_out_.Run(num_shards(), [&](int i) { status[i] = part(i); });
    for (int32_t i = 0; i < num_shards(); ++i) {
      if (!status[i].ok()) return Named(i, status[i]);
    }
    return absl::OkStatus();
  }

  const DcaGeometry geometry_;
  const KvLayout layout_;
  const std::vector<std::unique_ptr<Engine>> shards_;
  std::string device_name_;
  std::string device_;
  FanOut fan_out_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> CreateShardedEngine(
    const DcaGeometry& geometry, std::vector<std::unique_ptr<Engine>> shards) {
  if (shards.empty()) return absl::InvalidArgumentError("sharded engine: no shards");
  if (shards.size() == 1) return std::move(shards[0]);
  const int32_t n = static_cast<int32_t>(shards.size());
  ATTND_ASSIGN_OR_RETURN(const DcaGeometry shard_geometry, ShardGeometry(geometry, n));
  const KvLayout& first = shards[0]->layout();
  for (int32_t i = 0; i < n; ++i) {
    const KvLayout& l = shards[i]->layout();
    const DcaGeometry& g = shards[i]->geometry();
    if (g.num_kv_heads != shard_geometry.num_kv_heads ||
        g.num_q_heads != shard_geometry.num_q_heads || l.num_kv_heads != g.num_kv_heads ||
        l.num_layers != first.num_layers || l.num_pages != first.num_pages ||
        l.page_size != first.page_size || l.head_dim != first.head_dim ||
        l.kv_dtype != first.kv_dtype || shards[i]->backend() != shards[0]->backend()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sharded engine: shard ", i, " (", g.num_kv_heads, " kv heads, ",
                       l.num_pages, " pages) does not match shard 0 and ",
                       shard_geometry.num_kv_heads, " kv heads per shard"));
    }
  }
  KvLayout layout = first;
  layout.num_kv_heads = geometry.num_kv_heads;
  return std::unique_ptr<Engine>(new ShardedEngine(geometry, layout, std::move(shards)));
}

}  // namespace attnd
