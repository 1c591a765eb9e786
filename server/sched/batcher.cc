#include "server/sched/batcher.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnd {
namespace {

// How long a call submitted with RequestContext::more_follow, due at once, waits for the calls
// behind it before the timer launches it alone: they are already posted, so they come within
// microseconds unless the submitter failed to read them.
constexpr absl::Duration kWaitForFollowers = absl::Microseconds(500);

}  // namespace

const int64_t DecodeBatchingStats::kDelayBucketUpperUs[DecodeBatchingStats::kNumDelayBuckets] = {
    10,   25,   50,    100,   250,   500,    1000,
    2500, 5000, 10000, 25000, 50000, 100000, std::numeric_limits<int64_t>::max()};

absl::StatusOr<DecodeResult> RuntimeDecodeExecutor::Decode(const DecodeCall& call) {
  return runtime_->Decode(call);
}

absl::StatusOr<std::vector<int32_t>> ParseBatchSizes(absl::string_view text) {
  std::vector<int32_t> sizes;
  if (absl::StripAsciiWhitespace(text).empty()) return sizes;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    int32_t size = 0;
    if (!absl::SimpleAtoi(item, &size) || size <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch sizes must be positive integers, got \"", item, "\""));
    }
    if (!sizes.empty() && size <= sizes.back()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch sizes must be strictly increasing, got ", size, " after ", sizes.back()));
    }
    sizes.push_back(size);
  }
  return sizes;
}

absl::Status CheckDecodeBatcherOptions(const DecodeBatcherOptions& o) {
  if (o.max_decode_batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DecodeBatcherOptions::max_decode_batch must be >= 1, got ", o.max_decode_batch));
  }
  if (o.max_queue_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeBatcherOptions::max_queue_delay must be >= 0, got ",
                     absl::FormatDuration(o.max_queue_delay)));
  }
  for (size_t i = 0; i < o.flush_batch_sizes.size(); ++i) {
    const int32_t s = o.flush_batch_sizes[i];
    if (s <= 0 || (i > 0 && s <= o.flush_batch_sizes[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DecodeBatcherOptions::flush_batch_sizes must be positive and strictly increasing, got ",
          s, i > 0 ? absl::StrCat(" after ", o.flush_batch_sizes[i - 1]) : std::string()));
    }
  }
  if (o.max_inflight_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DecodeBatcherOptions::max_inflight_batches must be >= 1, got ", o.max_inflight_batches));
  }
  if (o.max_queued_calls < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max queued calls must be >= 1, got ", o.max_queued_calls));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<BatchingDecodeQueue>> BatchingDecodeQueue::Create(
    const DecodeBatcherOptions& options, DecodeExecutor* executor, BatchDispatchFn dispatch,
    const Clock* clock, bool start_timer) {
  if (absl::Status s = CheckDecodeBatcherOptions(options); !s.ok()) return s;
  if (executor == nullptr || !dispatch || clock == nullptr) {
    return absl::InvalidArgumentError("decode batcher: no executor, dispatcher or clock");
  }
  std::unique_ptr<BatchingDecodeQueue> queue(
      new BatchingDecodeQueue(options, executor, std::move(dispatch), clock));
  if (start_timer) queue->timer_ = std::thread([q = queue.get()] { q->TimerLoop(); });
  return queue;
}

BatchingDecodeQueue::BatchingDecodeQueue(const DecodeBatcherOptions& options,
                                         DecodeExecutor* executor, BatchDispatchFn dispatch,
                                         const Clock* clock)
    : options_(options), executor_(executor), dispatch_(std::move(dispatch)), clock_(clock) {
  for (int32_t s : options_.flush_batch_sizes) {
    if (s <= options_.max_decode_batch) flush_sizes_.push_back(s);
  }
}

BatchingDecodeQueue::~BatchingDecodeQueue() {
  Shutdown();
  MutexLock lock(&mu_);
  mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return IdleLocked(); });
}

absl::Status BatchingDecodeQueue::Submit(DecodeCall call, const RequestContext& context,
                                         Done done) {
  const absl::Time now = clock_->Now();
  std::vector<Answer> answers;
  std::vector<std::shared_ptr<Batch>> batches;
  {
    MutexLock lock(&mu_);
    if (!accepting_) return absl::UnavailableError("the server is shutting down");
    if (queued_calls_ >= options_.max_queued_calls) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the decode batch queue is full (", queued_calls_, " calls waiting); retry later"));
    }
    auto pending = std::make_unique<Pending>();
    pending->num_entries = static_cast<int64_t>(call.entries.size());
    pending->call = std::move(call);
    pending->context = context;
    pending->done = std::move(done);
    pending->arrival = now;
    if (context.more_follow) pending->hold_until = now + kWaitForFollowers;
    Key key(pending->call.layer, std::string(pending->call.tenant));
    KeyState& state = keys_[key];
    const absl::Time deadline = pending->context.deadline;
    state.queue.push_back(std::move(pending));
    ++queued_calls_;
    ++stats_.calls_submitted;
    TakeDueLocked(key, now, &answers, &batches);
    auto it = keys_.find(key);
    if (it != keys_.end()) WakeTimerLocked(std::min(deadline, PlanLocked(it->second, now).wake));
  }
  Deliver(std::move(answers), std::move(batches), context.run_on_caller);
  return absl::OkStatus();
}

BatchingDecodeQueue::Plan BatchingDecodeQueue::PlanLocked(const KeyState& state,
                                                          absl::Time now) const {
  Plan plan;
  if (state.queue.empty() || state.inflight >= options_.max_inflight_batches) return plan;
  const int64_t max = options_.max_decode_batch;
  absl::flat_hash_set<absl::string_view> taken;  // sequences of the calls already in the batch
  int64_t n = 0;
  bool closed = false;
  size_t i = 0;
  for (; i < state.queue.size(); ++i) {
    const Pending& c = *state.queue[i];
    // An empty call is malformed: it runs alone so the runtime's error reaches only it.
    if (c.num_entries == 0) {
      if (i == 0) ++i;
      closed = true;
      break;
    }
    if (i > 0 && n + c.num_entries > max) {
      closed = true;
      break;
    }
    bool conflict = false;
    for (const DecodeCall::Entry& e : c.call.entries) {
      if (taken.contains(e.sequence_id) || state.inflight_sequences.contains(e.sequence_id)) {
        conflict = true;
        break;
      }
    }
    if (conflict) {
      closed = true;
      break;
    }
    for (const DecodeCall::Entry& e : c.call.entries) taken.insert(e.sequence_id);
    n += c.num_entries;
    if (n >= max) {
      ++i;
      closed = true;
      break;
    }
  }
  plan.num_calls = i;
  if (i == 0) return plan;  // the head waits for a batch in flight (same sequence)
  const absl::Time due = state.queue.front()->arrival + options_.max_queue_delay;
  // The batch's last call has more calls of its submitter right behind it: they join it.
  const absl::Time held = closed ? absl::InfinitePast() : state.queue[i - 1]->hold_until;
  plan.launch =
      closed || !accepting_ ||
      (now >= held && (now >= due || std::binary_search(flush_sizes_.begin(), flush_sizes_.end(),
                                                        static_cast<int32_t>(n))));
  if (!plan.launch) plan.wake = now < held ? held : due;
  return plan;
}

void BatchingDecodeQueue::DropExpiredLocked(KeyState* state, absl::Time now,
                                            std::vector<Answer>* answers) {
  auto& q = state->queue;
  for (auto it = q.begin(); it != q.end();) {
    Pending& c = **it;
    absl::Status status;
    if (now >= c.context.deadline) {
      status = absl::DeadlineExceededError(
          "the decode's deadline passed while it was queued; nothing was changed");
      ++stats_.calls_deadline_exceeded;
    } else if (c.context.IsCancelled()) {
      status = absl::CancelledError(
          "the client cancelled the decode while it was queued; nothing was changed");
      ++stats_.calls_cancelled;
    } else {
      ++it;
      continue;
    }
    answers->emplace_back(std::move(c.done), std::move(status));
    it = q.erase(it);
    --queued_calls_;
  }
}

void BatchingDecodeQueue::TakeDueLocked(const Key& key, absl::Time now,
                                        std::vector<Answer>* answers,
                                        std::vector<std::shared_ptr<Batch>>* batches) {
  auto it = keys_.find(key);
  if (it == keys_.end()) return;
  KeyState& state = it->second;
  DropExpiredLocked(&state, now, answers);
  for (;;) {
    const Plan plan = PlanLocked(state, now);
    if (!plan.launch) break;
    auto batch = std::make_shared<Batch>();
    batch->key = key;
    for (size_t i = 0; i < plan.num_calls; ++i) {
      std::unique_ptr<Pending> c = std::move(state.queue.front());
      state.queue.pop_front();
      for (const DecodeCall::Entry& e : c->call.entries) {
        batch->sequences.emplace_back(e.sequence_id);
        state.inflight_sequences.insert(batch->sequences.back());
      }
      batch->num_entries += c->num_entries;
      batch->calls.push_back(std::move(c));
    }
    queued_calls_ -= static_cast<int64_t>(plan.num_calls);
    ++state.inflight;
    ++inflight_batches_;
    ++stats_.batches;
    stats_.entries += batch->num_entries;
    ++stats_.batches_by_size[static_cast<int32_t>(batch->num_entries)];
    batches->push_back(std::move(batch));
  }
  if (state.queue.empty() && state.inflight == 0) keys_.erase(it);
}

void BatchingDecodeQueue::FinishBatchLocked(const Batch& batch) {
  auto it = keys_.find(batch.key);
  if (it == keys_.end()) return;  // cannot happen: a key with a batch in flight is kept
  KeyState& state = it->second;
  for (const std::string& id : batch.sequences) state.inflight_sequences.erase(id);
  --state.inflight;
  --inflight_batches_;
  if (state.queue.empty() && state.inflight == 0) keys_.erase(it);
}

void BatchingDecodeQueue::Deliver(std::vector<Answer> answers,
                                  std::vector<std::shared_ptr<Batch>> batches, bool here) {
  for (Answer& a : answers) a.first(absl::StatusOr<DecodeResult>(std::move(a.second)));
  for (std::shared_ptr<Batch>& batch : batches) {
    if (here) {
      RunBatch(batch);
      continue;
    }
    absl::Status s = dispatch_([this, batch] { RunBatch(batch); });
    if (s.ok()) continue;
    {
      MutexLock lock(&mu_);
      FinishBatchLocked(*batch);
      // The slot is free again: whatever queued behind it is due on the next Poll.
      WakeTimerLocked(absl::InfinitePast());
    }
    for (auto& c : batch->calls) c->done(absl::StatusOr<DecodeResult>(s));
  }
}

void BatchingDecodeQueue::RunBatch(std::shared_ptr<Batch> batch) {
  while (batch != nullptr) {
    std::vector<Result> results = Execute(batch.get());
    std::vector<Answer> answers;
    std::vector<std::shared_ptr<Batch>> batches;
    {
      MutexLock lock(&mu_);
      FinishBatchLocked(*batch);
      const absl::Time now = clock_->Now();
      TakeDueLocked(batch->key, now, &answers, &batches);
      auto it = keys_.find(batch->key);
      if (it != keys_.end()) WakeTimerLocked(PlanLocked(it->second, now).wake);
    }
    // The key's next batch runs here, on this worker; any others (max_inflight_batches > 1) are
    // dispatched.
    batch = nullptr;
    if (!batches.empty()) {
      batch = std::move(batches.front());
      batches.erase(batches.begin());
    }
    Deliver(std::move(answers), std::move(batches));
    DeliverResults(std::move(results), /*all_elsewhere=*/batch != nullptr);
  }
}

std::vector<BatchingDecodeQueue::Result> BatchingDecodeQueue::Execute(Batch* batch) {
  const absl::Time start = clock_->Now();
  {
    MutexLock lock(&mu_);
    for (const auto& c : batch->calls) {
      const int64_t us = std::max<int64_t>(0, absl::ToInt64Microseconds(start - c->arrival));
      int b = 0;
      while (us > DecodeBatchingStats::kDelayBucketUpperUs[b]) ++b;
      ++stats_.queue_delay_count[b];
      stats_.queue_delay_total_us += us;
    }
  }

  int64_t eager = 0, graphs = 0, padding = 0, completed = 0, deadline = 0, cancelled = 0;
  // Answers are collected and handed out by RunBatch once the slot is free (DeliverResults), so
  // the replies' serialisation runs on several workers instead of delaying this key's next batch.
  std::vector<Result> results;
  auto answer = [&](Pending* c, absl::StatusOr<DecodeResult> r) {
    const absl::StatusCode code = r.status().code();
    ++(code == absl::StatusCode::kDeadlineExceeded ? deadline
       : code == absl::StatusCode::kCancelled      ? cancelled
                                                   : completed);
    results.emplace_back(std::move(c->done), std::move(r));
  };
  auto run = [&](const DecodeCall& call, int64_t n) {
    absl::StatusOr<DecodeResult> r = executor_->Decode(call);
    const DecodeStats ran = r.ok() ? r->stats : DecodeStats();
    ++(ran.graph_replays > 0 ? graphs : eager);
    padding += ran.padding_entries;
    if (r.ok() && static_cast<int64_t>(r->outputs.size()) != n) {
      return absl::StatusOr<DecodeResult>(
          absl::InternalError(absl::StrCat("decode batcher: the executor returned ",
                                           r->outputs.size(), " outputs for ", n, " entries")));
    }
    if (r.ok() && options_.on_batch) options_.on_batch(n, ran);
    return r;
  };

  // Each call's context is checked once, here on the worker just before the launch (a call alone
  // included; not again if the call is re-run on its own below).
  std::vector<Pending*> calls;
  for (const auto& c : batch->calls) {
    if (absl::Status s = AdmitAt(c->context, start); !s.ok()) {
      answer(c.get(), std::move(s));
      continue;
    }
    calls.push_back(c.get());
  }

  bool split = false;
  if (calls.size() == 1) {
    answer(calls.front(), run(calls.front()->call, calls.front()->num_entries));
  } else if (calls.size() > 1) {
    DecodeCall merged;
    merged.layer = batch->key.first;
    merged.tenant = batch->key.second;
    int64_t n = 0;
    std::vector<const std::function<absl::Status()>*> commits;
    for (const Pending* c : calls) {
      merged.entries.insert(merged.entries.end(), c->call.entries.begin(), c->call.entries.end());
      n += c->num_entries;
      if (c->call.before_commit) commits.push_back(&c->call.before_commit);
    }
    // A call whose hook fails fails the merged batch; the split below then fails only that call.
    if (!commits.empty()) {
      merged.before_commit = [&commits]() -> absl::Status {
        for (const auto* commit : commits) {
          if (absl::Status s = (*commit)(); !s.ok()) return s;
        }
        return absl::OkStatus();
      };
    }
    absl::StatusOr<DecodeResult> result = run(merged, n);
    if (result.ok()) {
      size_t offset = 0;
      for (Pending* c : calls) {
        DecodeResult own;
        auto first = result->outputs.begin() + static_cast<std::ptrdiff_t>(offset);
        own.outputs.assign(std::make_move_iterator(first),
                           std::make_move_iterator(first + c->num_entries));
        offset += static_cast<size_t>(c->num_entries);
        answer(c, std::move(own));
      }
    } else {
      // The merged batch changed nothing; each call now gets the answer it alone would get.
      split = true;
      for (Pending* c : calls) answer(c, run(c->call, c->num_entries));
    }
  }
  {
    MutexLock lock(&mu_);
    stats_.calls_completed += completed;
    stats_.calls_deadline_exceeded += deadline;
    stats_.calls_cancelled += cancelled;
    stats_.eager_launches += eager;
    stats_.graph_replays += graphs;
    stats_.padding_entries += padding;
    if (split) ++stats_.split_retries;
  }
  return results;
}

void BatchingDecodeQueue::DeliverResults(std::vector<Result> results, bool all_elsewhere) {
  // Groups of kPerWorker replies go to other workers; the first group is answered here unless
  // all_elsewhere. A group the dispatcher refuses (shutdown) is answered here too: no reply is
  // ever lost.
  constexpr size_t kPerWorker = 4;
  const size_t here = all_elsewhere ? 0 : std::min(results.size(), kPerWorker);
  std::vector<std::shared_ptr<std::vector<Result>>> refused;
  for (size_t first = here; first < results.size(); first += kPerWorker) {
    auto group = std::make_shared<std::vector<Result>>();
    const size_t last = std::min(results.size(), first + kPerWorker);
    for (size_t i = first; i < last; ++i) group->push_back(std::move(results[i]));
    const absl::Status s = dispatch_([group] {
      for (Result& r : *group) r.first(std::move(r.second));
    });
    if (!s.ok()) refused.push_back(std::move(group));
  }
  for (size_t i = 0; i < here; ++i) results[i].first(std::move(results[i].second));
  for (auto& group : refused) {
    for (Result& r : *group) r.first(std::move(r.second));
  }
}

void BatchingDecodeQueue::Poll() {
  const absl::Time now = clock_->Now();
  std::vector<Answer> answers;
  std::vector<std::shared_ptr<Batch>> batches;
  {
    MutexLock lock(&mu_);
    std::vector<Key> keys;
    keys.reserve(keys_.size());
    for (const auto& [key, state] : keys_) keys.push_back(key);
    for (const Key& key : keys) TakeDueLocked(key, now, &answers, &batches);
  }
  Deliver(std::move(answers), std::move(batches));
}

absl::Time BatchingDecodeQueue::NextWakeup() const {
  const absl::Time now = clock_->Now();
  MutexLock lock(&mu_);
  absl::Time wake = absl::InfiniteFuture();
  for (const auto& [key, state] : keys_) {
    const Plan plan = PlanLocked(state, now);
    if (plan.launch) return now;
    wake = std::min(wake, plan.wake);
    for (const auto& c : state.queue) wake = std::min(wake, c->context.deadline);
  }
  return wake;
}

void BatchingDecodeQueue::WakeTimerLocked(absl::Time t) {
  if (t >= timer_target_) return;
  ++wake_generation_;
  timer_cv_.Signal();
}

void BatchingDecodeQueue::TimerLoop() {
  MutexLock lock(&mu_);
  while (!timer_stop_) {
    const uint64_t generation = wake_generation_;
    // While it computes, any change wakes it (it is not yet sleeping toward a target).
    timer_target_ = absl::InfiniteFuture();
    mu_.Unlock();
    const absl::Time wake = NextWakeup();
    const absl::Time now = clock_->Now();
    if (wake <= now) Poll();
    mu_.Lock();
    if (wake <= now || generation != wake_generation_ || timer_stop_) continue;
    timer_target_ = wake;
    timer_cv_.WaitWithTimeout(&mu_, wake - now);  // InfiniteDuration when nothing is waiting
  }
}

void BatchingDecodeQueue::Shutdown() {
  MutexLock join_lock(&shutdown_mu_);
  {
    MutexLock lock(&mu_);
    accepting_ = false;
    timer_stop_ = true;
    timer_cv_.SignalAll();
  }
  if (timer_.joinable()) timer_.join();
  Poll();  // with accepting_ false every batch is due now
}

DecodeBatchingStats BatchingDecodeQueue::Stats() const {
  MutexLock lock(&mu_);
  DecodeBatchingStats s = stats_;
  s.queued_calls = queued_calls_;
  s.inflight_batches = inflight_batches_;
  return s;
}

}  // namespace attnd
