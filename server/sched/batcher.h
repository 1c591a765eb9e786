// Cross-RPC decode batching: decode calls from all concurrent Decode RPCs and Session streams that
// target the same layer are merged into one engine batch (one executor call), the way Triton's
// dynamic batcher merges inference requests. The batcher knows nothing of CUDA graphs: a batch
// that reaches one of the engine's batch sizes (Engine::decode_batch_sizes, the captured sizes on
// CUDA) launches at once, and the engine pads and replays as it sees fit and says what it ran
// (DecodeStats).
//
// Batch formation, per (layer, tenant) key, all of it FIFO by arrival:
//   * A batch is the longest prefix of the key's queue that fits: at most max_decode_batch entries
//     and no sequence named twice (by two calls, or by a call and a batch of the key in flight).
//     The first call that does not fit closes the batch and heads the next one; a call is never
//     overtaken by a later one of its key, so nobody starves: a call waits at most for the entries
//     queued ahead of it. A single call larger than max_decode_batch runs alone (calls are
//     all-or-nothing, so they are never split).
//   * At most max_inflight_batches batches per key run at a time (1 here; the server's
//     --decode-batches-in-flight defaults to 2): while a layer's batches run, the next one
//     accumulates, which is what makes batches grow under load.
//   * When a slot is free the batch launches at once if it was closed (the next call would pass
//     max_decode_batch or repeats a sequence), is full, or its size is one of the captured sizes;
//     otherwise it waits until its oldest call has waited max_queue_delay (0 = never wait).
//     A batch whose last call came with RequestContext::more_follow (its submitter posted more
//     right behind it) waits up to 500 us for the next one unless it is closed.
//   * Layers (and tenants) are independent: each key has its own queue and slots.
//   * A queued call whose deadline passes, or whose client cancels, is answered DEADLINE_EXCEEDED /
//     CANCELLED when the batcher next looks at its key (on any Submit, at the next timer wake-up,
//     when a batch of the key finishes), without touching the KV pool.
//   * On the worker, just before a batch launches, each of its calls' contexts is checked once
//     more (AdmitAt, server/sched/request_context.h: the deadline may pass, or the client cancel,
//     between the flush and the launch); the context's observer is told the call started. A call
//     refused there is answered with that status and left out of the batch.
//   * A merged batch that fails (validation, out of pages, engine error) changed nothing (the
//     runtime is all-or-nothing), so its calls are re-run one by one: each call gets exactly the
//     status it would have got on its own, and a bad call fails only its own RPC.
//   * Shutdown: new calls get UNAVAILABLE; queued calls are flushed at once (no delay) and run to
//     completion; only calls the dispatcher then refuses (e.g. a stopped work queue) get its
//     status.
#ifndef ATTND_SERVER_SCHED_BATCHER_H_
#define ATTND_SERVER_SCHED_BATCHER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "server/runtime/runtime.h"
#include "server/sched/decode_queue.h"
#include "server/sched/request_context.h"

namespace attnd {

// Runs one (merged) decode batch. Thread-safe for batches on disjoint sequences.
class DecodeExecutor {
 public:
  virtual ~DecodeExecutor() = default;
  // Runs `call` as one engine batch with the runtime's all-or-nothing semantics; the result's
  // stats say what the engine ran.
  virtual absl::StatusOr<DecodeResult> Decode(const DecodeCall& call) = 0;
};

// Executes through Runtime::Decode.
class RuntimeDecodeExecutor : public DecodeExecutor {
 public:
  explicit RuntimeDecodeExecutor(Runtime* runtime) : runtime_(runtime) {}
  absl::StatusOr<DecodeResult> Decode(const DecodeCall& call) override;

 private:
  Runtime* const runtime_;
};

// Runs a closure on some worker thread (the server's WorkQueue::Submit). A refused closure is
// destroyed unrun and its status is given to the batch's calls.
using BatchDispatchFn = std::function<absl::Status(std::function<void()>)>;

// Parses "1,2,4,8" (positive, strictly increasing). INVALID_ARGUMENT names the bad item.
absl::StatusOr<std::vector<int32_t>> ParseBatchSizes(absl::string_view text);

struct DecodeBatcherOptions {
  int32_t max_decode_batch = 256;                            // entries per batch, >= 1
  absl::Duration max_queue_delay = absl::Microseconds(100);  // 0 = never wait for more calls
  // A batch that reaches one of these sizes launches at once: the engine's batch sizes
  // (Engine::decode_batch_sizes), or the configured list where the engine has none. Sizes above
  // max_decode_batch are ignored. Empty: no size-based flush.
  std::vector<int32_t> flush_batch_sizes = DefaultDecodeBatchSizes();
  int32_t max_inflight_batches = 1;  // per (layer, tenant), >= 1
  int64_t max_queued_calls = 4096;   // Submit beyond it: RESOURCE_EXHAUSTED
  // Called on the worker with the entry count of each engine launch that succeeded (an executed
  // batch; e.g. a metrics histogram) and what the engine ran. Unset: nothing.
  std::function<void(int64_t entries, const DecodeStats& ran)> on_batch;
};

absl::Status CheckDecodeBatcherOptions(const DecodeBatcherOptions& options);

// A snapshot of the batcher's counters (cumulative since start).
struct DecodeBatchingStats {
  int64_t calls_submitted = 0;
  int64_t calls_completed = 0;  // answered with the executor's result
  // Answered DEADLINE_EXCEEDED / CANCELLED without running: while queued, or by the check of its
  // context just before its batch ran.
  int64_t calls_deadline_exceeded = 0;
  int64_t calls_cancelled = 0;
  int64_t batches = 0;                         // merged batches formed
  int64_t entries = 0;                         // entries in them
  std::map<int32_t, int64_t> batches_by_size;  // entries -> batches
  int64_t padding_entries = 0;                 // padding rows the engine ran (DecodeStats)
  int64_t eager_launches = 0;                  // executor calls that did not replay a graph
  int64_t graph_replays = 0;                   // executor calls that did
  int64_t split_retries = 0;  // merged batches that failed and were re-run call by call
  // Time from Submit to the executor starting the call's batch.
  static constexpr int kNumDelayBuckets = 14;
  static const int64_t kDelayBucketUpperUs[kNumDelayBuckets];  // last is the overflow bucket
  int64_t queue_delay_count[kNumDelayBuckets] = {};
  int64_t queue_delay_total_us = 0;
  int64_t queued_calls = 0;      // now
  int64_t inflight_batches = 0;  // now
};

// Thread-safe: Submit, Poll, Stats and Shutdown may be called from any thread.
class BatchingDecodeQueue : public DecodeQueue {
 public:
  // executor and clock must outlive the queue. Batches run through `dispatch`; with
  // `start_timer` a thread wakes when a batch's delay or a call's deadline is due and calls Poll
  // (tests leave it off and call Poll themselves after moving a ManualClock). INVALID_ARGUMENT for
  // bad options.
  static absl::StatusOr<std::unique_ptr<BatchingDecodeQueue>> Create(
      const DecodeBatcherOptions& options, DecodeExecutor* executor, BatchDispatchFn dispatch,
      const Clock* clock, bool start_timer);
  // Shutdown, then waits until every batch has finished.
  ~BatchingDecodeQueue() override;
  BatchingDecodeQueue(const BatchingDecodeQueue&) = delete;
  BatchingDecodeQueue& operator=(const BatchingDecodeQueue&) = delete;

  using DecodeQueue::Submit;
  // UNAVAILABLE after Shutdown; RESOURCE_EXHAUSTED when max_queued_calls are waiting. done is
  // called exactly once iff this returns OK.
  absl::Status Submit(DecodeCall call, const RequestContext& context, Done done) override;

  // Drops expired and cancelled calls and launches every batch that is due now.
  void Poll();
  // When Poll next has something to do (InfiniteFuture: nothing is waiting on time).
  absl::Time NextWakeup() const;

  // Stops accepting and flushes every queued call without waiting for the delay. Idempotent.
  void Shutdown();

  DecodeBatchingStats Stats() const;
  const DecodeBatcherOptions& options() const { return options_; }

 private:
  BatchingDecodeQueue(const DecodeBatcherOptions& options, DecodeExecutor* executor,
                      BatchDispatchFn dispatch, const Clock* clock);

  struct Pending {
    DecodeCall call;
    RequestContext context;
    Done done;
    absl::Time arrival;
    // RequestContext::more_follow: until then a batch that ends with this call waits for the
    // submitter's next one (unless it is full).
    absl::Time hold_until = absl::InfinitePast();
    int64_t num_entries = 0;
  };
  using Key = std::pair<int32_t, std::string>;  // (layer, tenant)
  struct KeyState {
    std::deque<std::unique_ptr<Pending>> queue;
    int32_t inflight = 0;
    absl::flat_hash_set<std::string> inflight_sequences;
  };
  struct Batch {
    Key key;
    std::vector<std::unique_ptr<Pending>> calls;
    int64_t num_entries = 0;
    // Owned copies: a call's ids point into its request, which may be gone once it is answered.
    std::vector<std::string> sequences;
  };
  // A dropped call and its answer, delivered outside the lock.
  using Answer = std::pair<Done, absl::Status>;
  // An executed call and its result.
  using Result = std::pair<Done, absl::StatusOr<DecodeResult>>;
  // How the head of a key's queue would be batched now.
  struct Plan {
    size_t num_calls = 0;
    bool launch = false;
    absl::Time wake = absl::InfiniteFuture();  // when the batch becomes due (if not launching)
  };

  Plan PlanLocked(const KeyState& state, absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void DropExpiredLocked(KeyState* state, absl::Time now, std::vector<Answer>* answers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes every batch of `key` that is due now.
  void TakeDueLocked(const Key& key, absl::Time now, std::vector<Answer>* answers,
                     std::vector<std::shared_ptr<Batch>>* batches)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers dropped calls and dispatches batches (a refused batch's calls get the refusal).
  // Answers the dropped calls and starts the batches: on the workers (dispatch_), or here, one
  // after the other, when `here` (RequestContext::run_on_caller).
  void Deliver(std::vector<Answer> answers, std::vector<std::shared_ptr<Batch>> batches,
               bool here = false);
  // On a worker: executes the batch, frees its slot, then runs the key's next due batch on this
  // same thread (which is also how calls queued behind it drain at shutdown). The executed
  // batch's replies go to other workers when a next batch follows, so serialising them never
  // delays it; otherwise the first few are answered here.
  void RunBatch(std::shared_ptr<Batch> batch);
  std::vector<Result> Execute(Batch* batch);
  // Calls each result's Done: groups on other workers (dispatch_), the first group here unless
  // `all_elsewhere`; a group the dispatcher refuses is answered here.
  void DeliverResults(std::vector<Result> results, bool all_elsewhere);
  void FinishBatchLocked(const Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TimerLoop();
  // Wakes the timer thread if `t` is earlier than what it sleeps until.
  void WakeTimerLocked(absl::Time t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queued_calls_ == 0 && inflight_batches_ == 0;
  }

  const DecodeBatcherOptions options_;
  std::vector<int32_t> flush_sizes_;  // ascending, <= max_decode_batch
  DecodeExecutor* const executor_;
  const BatchDispatchFn dispatch_;
  const Clock* const clock_;

  mutable Mutex mu_;
  std::map<Key, KeyState> keys_ ABSL_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool timer_stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t wake_generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped when a wake-up may move earlier
  absl::Time timer_target_ ABSL_GUARDED_BY(mu_) =
      absl::InfinitePast();  // what the timer sleeps until
  CondVar timer_cv_;
  int64_t queued_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t inflight_batches_ ABSL_GUARDED_BY(mu_) = 0;
  DecodeBatchingStats stats_ ABSL_GUARDED_BY(mu_);
  Mutex shutdown_mu_;  // serialises Shutdown callers (joining the timer)
  std::thread timer_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_SCHED_BATCHER_H_
