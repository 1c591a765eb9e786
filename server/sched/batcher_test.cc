// BatchingDecodeQueue with a ManualClock, a fake executor (all-or-nothing, per-sequence lengths,
// so order is observable) and a dispatcher that holds closures until the test runs them: every
// outcome is decided by the test's own steps, never by timing. The last tests run merged batches
// through the real Runtime + CPU engine against the fp64 naive reference.
#include "server/sched/batcher.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/dtype.h"
#include "base/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/testing/naive_dca.h"
#include "server/config/model_config.h"
#include "server/config/test_models.h"
#include "server/engine/engine_factory.h"
#include "server/runtime/runtime.h"
#include "server/sched/request_context.h"
#include "server/sched/work_queue.h"

namespace attnd {
namespace {

using ::testing::ElementsAre;

// Runtime-like: validates the whole call first (a call naming a "bad*" sequence, or one sequence
// twice, fails as a whole and changes nothing), then advances each sequence's length in its layer.
// Each output's bytes say "<id>@<length>".
class FakeExecutor : public DecodeExecutor {
 public:
  struct Launch {
    int32_t layer;
    std::string tenant;
    std::vector<std::string> ids;
  };

  absl::StatusOr<DecodeResult> Decode(const DecodeCall& call) override {
    Launch launch{call.layer, std::string(call.tenant), {}};
    for (const auto& e : call.entries) launch.ids.emplace_back(e.sequence_id);
    launches.push_back(launch);
    // What a graph engine reports: a replay, padded up to the next of graph_sizes, or an eager
    // launch past them.
    DecodeStats stats;
    const int64_t n = static_cast<int64_t>(call.entries.size());
    const auto size = std::lower_bound(graph_sizes.begin(), graph_sizes.end(), n);
    if (replay_graphs && size != graph_sizes.end()) {
      stats.graph_replays = 1;
      stats.padding_entries = *size - n;
    } else {
      stats.eager_launches = 1;
    }
    if (call.entries.empty())
      return absl::InvalidArgumentError("a decode needs at least one entry");
    std::set<std::string> seen;
    for (size_t i = 0; i < call.entries.size(); ++i) {
      const std::string id(call.entries[i].sequence_id);
      if (id.rfind("bad", 0) == 0) {
        return absl::NotFoundError(absl::StrCat("entries[", i, "]: sequence ", id, " not found"));
      }
      if (!seen.insert(id).second) {
        return absl::InvalidArgumentError(absl::StrCat("entries[", i, "]: ", id, " twice"));
      }
    }
    DecodeResult result;
    result.stats = stats;
    for (const auto& e : call.entries) {
      const int64_t len = ++lengths[{call.layer, std::string(e.sequence_id)}];
      DecodeResult::Output o;
      o.out = absl::StrCat(e.sequence_id, "@", len);
      o.length = len;
      result.outputs.push_back(std::move(o));
    }
    return result;
  }

  int64_t Length(int32_t layer, const std::string& id) const {
    auto it = lengths.find({layer, id});
    return it == lengths.end() ? 0 : it->second;
  }

  // The ids of each launch, e.g. {"a,b", "c"}.
  std::vector<std::string> Batches() const {
    std::vector<std::string> out;
    for (const Launch& l : launches) out.push_back(absl::StrJoin(l.ids, ","));
    return out;
  }

  std::vector<Launch> launches;
  std::map<std::pair<int32_t, std::string>, int64_t> lengths;
  bool replay_graphs = false;
  std::vector<int32_t> graph_sizes = {1, 2, 4, 8};
};

// Holds dispatched closures until RunAll; can refuse them like a stopped work queue.
class HeldDispatcher {
 public:
  BatchDispatchFn fn() {
    return [this](std::function<void()> f) -> absl::Status {
      if (!refuse.ok()) return refuse;
      held.push_back(std::move(f));
      return absl::OkStatus();
    };
  }
  int RunAll() {
    int n = 0;
    while (!held.empty()) {
      std::function<void()> f = std::move(held.front());
      held.pop_front();
      f();
      ++n;
    }
    return n;
  }
  std::deque<std::function<void()>> held;
  absl::Status refuse;
};

struct Reply {
  bool called = false;
  int times = 0;
  absl::StatusOr<DecodeResult> result = absl::UnknownError("not answered");
  // "a@1,b@1" for OK, else the status code name.
  std::string Summary() const {
    if (!called) return "pending";
    if (!result.ok()) return absl::StatusCodeToString(result.status().code());
    std::vector<std::string> outs;
    for (const auto& o : result->outputs) outs.push_back(o.out);
    return absl::StrJoin(outs, ",");
  }
};

class BatcherTest : public testing::Test {
 protected:
  void Make(DecodeBatcherOptions options) {
    auto q = BatchingDecodeQueue::Create(options, &exec_, dispatcher_.fn(), &clock_,
                                         /*start_timer=*/false);
    ASSERT_TRUE(q.ok()) << q.status();
    queue_ = *std::move(q);
  }

  void TearDown() override {
    if (queue_ == nullptr) return;
    queue_->Shutdown();
    dispatcher_.RunAll();  // the destructor waits for every batch
    queue_.reset();
  }

  // Submits a call naming `ids` (string literals: they must outlive the call) in `layer`.
  Reply* Submit(std::vector<const char*> ids, int32_t layer = 0, RequestContext context = {},
                absl::string_view tenant = "") {
    DecodeCall call;
    call.layer = layer;
    call.tenant = tenant;
    for (const char* id : ids) {
      DecodeCall::Entry e;
      e.sequence_id = id;
      call.entries.push_back(e);
    }
    replies_.emplace_back();
    Reply* r = &replies_.back();
    last_submit_ = queue_->Submit(std::move(call), context, [r](absl::StatusOr<DecodeResult> res) {
      r->called = true;
      ++r->times;
      r->result = std::move(res);
    });
    return r;
  }

  ManualClock clock_;
  FakeExecutor exec_;
  HeldDispatcher dispatcher_;
  std::unique_ptr<BatchingDecodeQueue> queue_;
  std::deque<Reply> replies_;
  absl::Status last_submit_;
};

DecodeBatcherOptions NoSizeFlush(absl::Duration delay = absl::Microseconds(100)) {
  DecodeBatcherOptions o;
  o.flush_batch_sizes = {};
  o.max_queue_delay = delay;
  return o;
}

TEST(BatcherOptionsTest, ParsesAndChecks) {
  EXPECT_EQ(*ParseBatchSizes("1, 2,4"), (std::vector<int32_t>{1, 2, 4}));
  EXPECT_TRUE(ParseBatchSizes("")->empty());
  absl::StatusOr<std::vector<int32_t>> bad = ParseBatchSizes("1,x");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "batch sizes must be positive integers, got \"x\"");
  bad = ParseBatchSizes("4,2");
  EXPECT_EQ(bad.status().message(), "batch sizes must be strictly increasing, got 2 after 4");
  EXPECT_EQ(ParseBatchSizes("0").status().code(), absl::StatusCode::kInvalidArgument);

  DecodeBatcherOptions o;
  EXPECT_TRUE(CheckDecodeBatcherOptions(o).ok());
  EXPECT_EQ(o.max_decode_batch, 256);
  EXPECT_EQ(o.max_queue_delay, absl::Microseconds(100));
  EXPECT_EQ(o.flush_batch_sizes,
            (std::vector<int32_t>{1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256}));
  EXPECT_EQ(o.flush_batch_sizes, DefaultDecodeBatchSizes());
  o.max_decode_batch = 0;
  EXPECT_EQ(CheckDecodeBatcherOptions(o).message(),
            "DecodeBatcherOptions::max_decode_batch must be >= 1, got 0");
  o.max_decode_batch = 8;
  o.max_queue_delay = absl::Microseconds(-1);
  EXPECT_EQ(CheckDecodeBatcherOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o.max_queue_delay = absl::ZeroDuration();
  o.flush_batch_sizes = {2, 2};
  EXPECT_EQ(CheckDecodeBatcherOptions(o).message(),
            "DecodeBatcherOptions::flush_batch_sizes must be positive and strictly increasing, got "
            "2 after 2");
  FakeExecutor exec;
  HeldDispatcher d;
  EXPECT_EQ(BatchingDecodeQueue::Create(o, &exec, d.fn(), Clock::Real(), false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// While a layer's batch runs, later calls accumulate; when it finishes they go as one batch, in
// arrival order, and each call gets back exactly its own outputs, in its own entry order.
TEST_F(BatcherTest, MergesQueuedCallsInArrivalOrderAndSplitsOutputs) {
  Make(DecodeBatcherOptions());
  Reply* first = Submit({"a"});  // alone on an idle layer: size 1 is a captured size, goes now
  EXPECT_EQ(dispatcher_.held.size(), 1u);
  Reply* r1 = Submit({"b", "c"});
  Reply* r2 = Submit({"d"});
  Reply* r3 = Submit({"e"});  // 4 entries queued: a captured size, but the layer's slot is busy
  EXPECT_EQ(dispatcher_.held.size(), 1u);
  EXPECT_EQ(queue_->Stats().queued_calls, 3);
  // The next batch runs on the same worker, not dispatched; the first batch's reply is handed to
  // another worker so that it does not delay that next batch: two closures in all.
  EXPECT_EQ(dispatcher_.RunAll(), 2);
  EXPECT_THAT(exec_.Batches(), ElementsAre("a", "b,c,d,e"));
  EXPECT_EQ(first->Summary(), "a@1");
  EXPECT_EQ(r1->Summary(), "b@1,c@1");
  EXPECT_EQ(r2->Summary(), "d@1");
  EXPECT_EQ(r3->Summary(), "e@1");
  for (const Reply& r : replies_) EXPECT_EQ(r.times, 1);
  const DecodeBatchingStats s = queue_->Stats();
  EXPECT_EQ(s.batches, 2);
  EXPECT_EQ(s.entries, 5);
  EXPECT_EQ(s.batches_by_size, (std::map<int32_t, int64_t>{{1, 1}, {4, 1}}));
  EXPECT_EQ(s.calls_submitted, 4);
  EXPECT_EQ(s.calls_completed, 4);
  EXPECT_EQ(s.eager_launches, 2);
  EXPECT_EQ(s.graph_replays, 0);
  EXPECT_EQ(s.queued_calls, 0);
  EXPECT_EQ(s.inflight_batches, 0);
}

// A merged batch's replies: with no batch of the key due next, the first four are answered on the
// batch's worker, the rest handed to other workers in groups of four (with one due, all are handed
// off: MergesQueuedCallsInArrivalOrderAndSplitsOutputs). A refused hand-off is answered in place:
// every call exactly once either way.
TEST_F(BatcherTest, RepliesOfAMergedBatchSpreadOverWorkersAndNoneIsLost) {
  for (const bool refuse : {false, true}) {
    SCOPED_TRACE(refuse ? "hand-off refused" : "hand-off accepted");
    replies_.clear();
    exec_.launches.clear();
    exec_.lengths.clear();
    Make(NoSizeFlush());
    std::vector<Reply*> r;
    const char* ids[] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"};
    for (const char* id : ids) r.push_back(Submit({id}));
    clock_.Advance(absl::Microseconds(100));
    queue_->Poll();
    ASSERT_EQ(dispatcher_.held.size(), 1u);  // the batch
    std::function<void()> batch = std::move(dispatcher_.held.front());
    dispatcher_.held.pop_front();
    if (refuse) dispatcher_.refuse = absl::UnavailableError("stopped");
    batch();
    EXPECT_THAT(exec_.Batches(), ElementsAre("a,b,c,d,e,f,g,h,i,j"));
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r[i]->times, 1) << i;
    if (!refuse) {
      EXPECT_EQ(dispatcher_.held.size(), 2u);  // replies 4..7 and 8..9
      for (int i = 4; i < 10; ++i) EXPECT_FALSE(r[i]->called) << i;
      EXPECT_EQ(dispatcher_.RunAll(), 2);
    } else {
      EXPECT_TRUE(dispatcher_.held.empty());
    }
    for (int i = 0; i < 10; ++i) {
      EXPECT_EQ(r[i]->times, 1) << i;
      EXPECT_EQ(r[i]->Summary(), std::string(ids[i]) + "@1") << i;
    }
    dispatcher_.refuse = absl::OkStatus();
    queue_->Shutdown();
    dispatcher_.RunAll();
    queue_.reset();
  }
}

TEST_F(BatcherTest, FlushesAtOnceOnReachingACapturedSize) {
  DecodeBatcherOptions o;
  o.flush_batch_sizes = {4, 8};
  Make(o);
  Submit({"a"});
  Submit({"b"});
  Submit({"c"});
  queue_->Poll();
  EXPECT_TRUE(dispatcher_.held.empty());  // 3 is not captured and no time has passed
  Submit({"d"});
  EXPECT_EQ(dispatcher_.held.size(), 1u);  // 4 is: launched without waiting
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b,c,d"));
  EXPECT_EQ(queue_->Stats().padding_entries, 0);  // the engine (here: eager) pads, not the batcher
}

// A call whose submitter only waits for it (a ring's thread: RequestContext::run_on_caller) runs
// the batch it completes right there, merged calls and all, before Submit returns; the next batch
// that batch makes due goes to the dispatcher as usual.
TEST_F(BatcherTest, ABatchTheCallersCallCompletesRunsOnTheCaller) {
  DecodeBatcherOptions o;
  o.flush_batch_sizes = {2};
  o.max_inflight_batches = 1;
  Make(o);
  Reply* a = Submit({"a"});
  RequestContext here;
  here.run_on_caller = true;
  Reply* b = Submit({"b"}, 0, here);
  EXPECT_TRUE(dispatcher_.held.empty());  // nothing handed to a worker
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b"));
  EXPECT_EQ(a->Summary(), "a@1");
  EXPECT_EQ(b->Summary(), "b@1");
  // Without it, the same completes on a worker.
  Reply* c = Submit({"c"});
  Reply* d = Submit({"d"});
  EXPECT_EQ(dispatcher_.held.size(), 1u);
  EXPECT_EQ(d->Summary(), "pending");
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b", "c,d"));
  EXPECT_EQ(c->Summary(), "c@1");
}

// Calls submitted with RequestContext::more_follow (a ring's micro-batches, posted together)
// wait for the call behind them, even where each alone would launch at once (its size is a
// captured one), and go with it as one batch; a held call whose follower never comes launches
// alone when the timer looks next, 500 us later.
TEST_F(BatcherTest, CallsWithMoreToFollowWaitForTheNextOne) {
  DecodeBatcherOptions o;
  o.flush_batch_sizes = {1, 2, 4};
  o.max_inflight_batches = 1;
  Make(o);
  RequestContext held;
  held.more_follow = true;
  Reply* a = Submit({"a"}, 0, held);
  Reply* b = Submit({"b"}, 0, held);
  EXPECT_TRUE(dispatcher_.held.empty());
  Reply* c = Submit({"c", "d"});
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b,c,d"));
  EXPECT_EQ(a->Summary(), "a@1");
  EXPECT_EQ(b->Summary(), "b@1");
  EXPECT_EQ(c->Summary(), "c@1,d@1");
  // Without it, the first call of size 1 would have gone at once.
  Reply* e = Submit({"e"});
  dispatcher_.RunAll();
  EXPECT_EQ(e->Summary(), "e@1");
  // A held call alone: still queued just before the wait ends, launched once it has.
  Reply* f = Submit({"f"}, 0, held);
  clock_.Advance(absl::Microseconds(499));
  queue_->Poll();
  dispatcher_.RunAll();
  EXPECT_EQ(f->Summary(), "pending");
  clock_.Advance(absl::Microseconds(1));
  queue_->Poll();
  dispatcher_.RunAll();
  EXPECT_EQ(f->Summary(), "f@1");
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b,c,d", "e", "f"));
}

TEST_F(BatcherTest, FlushesWhenTheNextCallWouldPassTheLimit) {
  DecodeBatcherOptions o = NoSizeFlush();
  o.max_decode_batch = 4;
  Make(o);
  Reply* r1 = Submit({"a", "b"});
  Reply* r2 = Submit({"c"});
  EXPECT_TRUE(dispatcher_.held.empty());
  Reply* r3 = Submit({"d", "e"});  // 3 + 2 > 4: the batch of 3 closes and goes now
  EXPECT_EQ(dispatcher_.held.size(), 1u);
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b,c"));
  EXPECT_EQ(r1->Summary(), "a@1,b@1");
  EXPECT_EQ(r2->Summary(), "c@1");
  EXPECT_FALSE(r3->called);  // heads the next batch, which waits for its own delay
  clock_.Advance(absl::Microseconds(100));
  queue_->Poll();
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b,c", "d,e"));
  EXPECT_EQ(r3->Summary(), "d@1,e@1");
}

TEST_F(BatcherTest, FlushesAFullBatchAndRunsAnOversizeCallAlone) {
  DecodeBatcherOptions o = NoSizeFlush();
  o.max_decode_batch = 4;
  Make(o);
  Submit({"a", "b"});
  Submit({"c", "d"});  // exactly full
  EXPECT_EQ(dispatcher_.held.size(), 1u);
  dispatcher_.RunAll();
  Reply* big = Submit({"e", "f", "g", "h", "i", "j"});  // larger than the limit: alone, at once
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b,c,d", "e,f,g,h,i,j"));
  EXPECT_EQ(big->Summary(), "e@1,f@1,g@1,h@1,i@1,j@1");
}

TEST_F(BatcherTest, WaitsAtMostTheQueueDelay) {
  Make(NoSizeFlush(absl::Microseconds(100)));
  const absl::Time t0 = clock_.Now();
  Reply* r1 = Submit({"a"});
  clock_.Advance(absl::Microseconds(40));
  Reply* r2 = Submit({"b"});
  EXPECT_EQ(queue_->NextWakeup(), t0 + absl::Microseconds(100));  // the oldest call's delay
  clock_.Advance(absl::Microseconds(59));
  queue_->Poll();
  EXPECT_TRUE(dispatcher_.held.empty());
  clock_.Advance(absl::Microseconds(1));
  EXPECT_EQ(queue_->NextWakeup(), clock_.Now());
  queue_->Poll();
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b"));
  EXPECT_EQ(r1->Summary(), "a@1");
  EXPECT_EQ(r2->Summary(), "b@1");
  EXPECT_EQ(queue_->NextWakeup(), absl::InfiniteFuture());
  // Queue delay: a waited 100 us, b 60 us; both in the (50, 100] bucket.
  const DecodeBatchingStats s = queue_->Stats();
  EXPECT_EQ(s.queue_delay_count[3], 2);
  EXPECT_EQ(DecodeBatchingStats::kDelayBucketUpperUs[3], 100);
  EXPECT_EQ(s.queue_delay_total_us, 160);
}

TEST_F(BatcherTest, DelayZeroNeverWaitsButStillMergesWhatQueuedBehindABusySlot) {
  Make(NoSizeFlush(absl::ZeroDuration()));
  Submit({"a"});
  EXPECT_EQ(dispatcher_.held.size(), 1u);  // no size rule, no time passed: delay 0 alone
  Submit({"b"});
  Submit({"c"});
  EXPECT_EQ(dispatcher_.held.size(), 1u);
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a", "b,c"));
}

TEST_F(BatcherTest, CancelledCallsAreDroppedWithoutReachingTheExecutor) {
  Make(DecodeBatcherOptions());
  Submit({"a"});  // in flight
  std::shared_ptr<std::atomic<bool>> cancel_b = NewCancelFlag(), cancel_d = NewCancelFlag();
  RequestContext cb, cd;
  cb.cancelled = cancel_b;
  cd.cancelled = cancel_d;
  Reply* b = Submit({"b"}, 0, cb);
  Reply* c = Submit({"c"});
  cancel_b->store(true);
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a", "c"));
  EXPECT_EQ(b->result.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(b->result.status().message(),
            "the client cancelled the decode while it was queued; nothing was changed");
  EXPECT_EQ(c->Summary(), "c@1");
  // Cancelled while waiting for its delay on an idle layer: dropped at the next look.
  Make(NoSizeFlush());
  Reply* d = Submit({"d"}, 0, cd);
  cancel_d->store(true);
  clock_.Advance(absl::Microseconds(100));
  queue_->Poll();
  EXPECT_TRUE(dispatcher_.held.empty());
  EXPECT_EQ(d->result.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(exec_.Length(0, "d"), 0);
  EXPECT_EQ(queue_->Stats().calls_cancelled, 1);
}

TEST_F(BatcherTest, ExpiredCallsAreDroppedAtTheirDeadline) {
  Make(NoSizeFlush(absl::Microseconds(100)));
  RequestContext soon;
  soon.deadline = clock_.Now() + absl::Microseconds(30);
  Reply* a = Submit({"a"}, 0, soon);
  Reply* b = Submit({"b"});
  EXPECT_EQ(queue_->NextWakeup(), soon.deadline);  // earlier than the batch's delay
  clock_.Advance(absl::Microseconds(30));
  queue_->Poll();
  EXPECT_EQ(a->result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(a->result.status().message(),
            "the decode's deadline passed while it was queued; nothing was changed");
  EXPECT_FALSE(b->called);
  clock_.Advance(absl::Microseconds(70));  // b's own delay (it arrived with a)
  queue_->Poll();
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("b"));
  EXPECT_EQ(queue_->Stats().calls_deadline_exceeded, 1);
  // A call that arrives already expired is answered, never run.
  RequestContext past;
  past.deadline = clock_.Now();
  Reply* late = Submit({"c"}, 0, past);
  EXPECT_TRUE(last_submit_.ok());
  EXPECT_EQ(late->result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(exec_.Batches(), ElementsAre("b"));
}

// FIFO by arrival: a call is never overtaken. A big call that does not fit closes the batch and
// heads the next one (so it cannot be starved by a stream of small calls behind it), and small
// calls ahead of it are not held back by it.
TEST_F(BatcherTest, FifoFairnessBetweenBigAndSmallClients) {
  DecodeBatcherOptions o = NoSizeFlush(absl::ZeroDuration());
  o.max_decode_batch = 8;
  Make(o);
  Submit({"s0"});  // in flight
  clock_.Advance(absl::Microseconds(1));
  Submit({"x1"});                                      // client X, small
  Submit({"b1", "b2", "b3", "b4", "b5", "b6", "b7"});  // client B, big: 1 + 7 = 8, full
  Submit({"x2"});                                      // small calls keep coming
  Submit({"x3"});
  Submit({"y1", "y2", "y3", "y4", "y5", "y6", "y7", "y8"});  // client Y: exactly the limit
  Submit({"x4"});
  dispatcher_.RunAll();
  clock_.Advance(absl::Microseconds(100));
  queue_->Poll();
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("s0", "x1,b1,b2,b3,b4,b5,b6,b7", "x2,x3",
                                           "y1,y2,y3,y4,y5,y6,y7,y8", "x4"));
  for (const Reply& r : replies_) EXPECT_TRUE(r.result.ok()) << r.Summary();
}

TEST_F(BatcherTest, LayersAndTenantsBatchIndependently) {
  Make(DecodeBatcherOptions());
  Submit({"a"}, 0);  // layer 0 in flight
  Submit({"a"}, 1);  // layer 1 has its own slot: in flight too, same sequence is fine
  EXPECT_EQ(dispatcher_.held.size(), 2u);
  Submit({"b"}, 0);
  Submit({"c"}, 1);
  Submit({"d"}, 0);
  Submit({"e"}, 0, {}, "tenant2");  // another tenant: another batch
  EXPECT_EQ(dispatcher_.held.size(), 3u);
  dispatcher_.RunAll();
  ASSERT_EQ(exec_.launches.size(), 5u);
  std::vector<std::string> got;
  for (const auto& l : exec_.launches) {
    got.push_back(absl::StrCat(l.layer, "/", l.tenant, ":", absl::StrJoin(l.ids, ",")));
  }
  std::sort(got.begin(), got.end());
  EXPECT_THAT(got, ElementsAre("0/:a", "0/:b,d", "0/tenant2:e", "1/:a", "1/:c"));
  EXPECT_EQ(exec_.Length(0, "a"), 1);
  EXPECT_EQ(exec_.Length(1, "a"), 1);
}

// A bad call in a merged batch fails only its own RPC, with the message it would get alone; the
// others run once (the failed merged attempt changed nothing).
TEST_F(BatcherTest, AFailingCallFailsOnlyItself) {
  Make(DecodeBatcherOptions());
  Submit({"a"});  // in flight
  Reply* good1 = Submit({"b", "c"});
  Reply* bad = Submit({"d", "bad-e"});
  Reply* dup = Submit({"f", "f"});  // the same sequence twice in one call: its own error
  Reply* good2 = Submit({"g"});
  clock_.Advance(absl::Microseconds(100));  // 7 entries is not a captured size: wait the delay
  dispatcher_.RunAll();
  EXPECT_EQ(good1->Summary(), "b@1,c@1");
  EXPECT_EQ(bad->result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(bad->result.status().message(), "entries[1]: sequence bad-e not found");
  EXPECT_EQ(dup->result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dup->result.status().message(), "entries[1]: f twice");
  EXPECT_EQ(good2->Summary(), "g@1");
  EXPECT_EQ(exec_.Length(0, "d"), 0);
  EXPECT_EQ(exec_.Length(0, "f"), 0);
  EXPECT_THAT(exec_.Batches(), ElementsAre("a", "b,c,d,bad-e,f,f,g", "b,c", "d,bad-e", "f,f", "g"));
  EXPECT_EQ(queue_->Stats().split_retries, 1);
  EXPECT_EQ(queue_->Stats().eager_launches, 6);
}

// Counts RequestObserver::OnStarted per call and keeps the last start time.
struct StartCounter : RequestObserver {
  void OnStarted(absl::Time t) override {
    ++starts;
    started = t;
  }
  int starts = 0;
  absl::Time started = absl::InfinitePast();
};

// Each call's context is checked exactly once, by the batcher on the worker just before its batch
// launches (a call alone included), and its observer told the start then: a deadline that passes,
// or a cancel that comes, after the flush but before the launch keeps that call out of the merged
// batch, answered with its own status; the rest run.
TEST_F(BatcherTest, ContextsAreCheckedOnceAtLaunchAndARefusedCallIsLeftOut) {
  DecodeBatcherOptions o;
  std::vector<int64_t> executed;  // on_batch sees only launches that succeeded
  o.on_batch = [&executed](int64_t n, const DecodeStats&) { executed.push_back(n); };
  Make(o);
  std::map<std::string, StartCounter> observers;
  auto context = [&](const char* id) {
    RequestContext c;
    c.enqueue_time = clock_.Now();
    c.observer = &observers[id];
    return c;
  };
  Submit({"a"}, 0, context("a"));  // alone, at once
  Reply* b = Submit({"b"}, 0, context("b"));
  RequestContext late = context("c");
  late.deadline = clock_.Now() + absl::Microseconds(150);  // after the flush, before the launch
  Reply* c = Submit({"c"}, 0, late);
  Reply* d = Submit({"d", "bad-d"}, 0, context("d"));
  RequestContext cancelled = context("e");
  std::shared_ptr<std::atomic<bool>> cancel_e = NewCancelFlag();
  cancelled.cancelled = cancel_e;
  Reply* e = Submit({"e"}, 0, cancelled);
  dispatcher_.RunAll();
  EXPECT_EQ(observers["a"].starts, 1);
  EXPECT_EQ(observers["b"].starts, 0);      // still queued: not started
  clock_.Advance(absl::Microseconds(100));  // 5 entries queued: not a captured size
  queue_->Poll();                           // the batch is flushed (held by the dispatcher)
  EXPECT_FALSE(c->called);
  EXPECT_FALSE(e->called);
  clock_.Advance(absl::Microseconds(50));  // c's deadline
  cancel_e->store(true);
  dispatcher_.RunAll();
  // c and e never reach the executor; the merged b,d,bad-d fails and is re-run call by call.
  EXPECT_THAT(exec_.Batches(), ElementsAre("a", "b,d,bad-d", "b", "d,bad-d"));
  for (const char* id : {"a", "b", "c", "d", "e"}) EXPECT_EQ(observers[id].starts, 1) << id;
  EXPECT_EQ(observers["b"].started, clock_.Now());  // the launch, for queue-wait metrics
  EXPECT_EQ(b->Summary(), "b@1");
  EXPECT_EQ(c->result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(c->result.status().message(),
            "the client's deadline passed while the request waited 0 in the queue; nothing was "
            "done");
  EXPECT_EQ(e->result.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(e->result.status().message(),
            "the call was cancelled before it started; nothing was done");
  EXPECT_EQ(d->result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(exec_.Length(0, "c"), 0);
  EXPECT_EQ(exec_.Length(0, "e"), 0);
  const DecodeBatchingStats s = queue_->Stats();
  EXPECT_EQ(s.calls_deadline_exceeded, 1);
  EXPECT_EQ(s.calls_cancelled, 1);
  EXPECT_EQ(s.calls_completed, 3);
  EXPECT_EQ(s.batches_by_size, (std::map<int32_t, int64_t>{{1, 1}, {5, 1}}));
  EXPECT_THAT(executed, ElementsAre(1, 1));
}

// A call dropped while queued (never dequeued) is not reported as started: its RPC records no
// queue wait, as before.
TEST_F(BatcherTest, ACallDroppedWhileQueuedIsNotStarted) {
  Make(NoSizeFlush());
  StartCounter observer;
  RequestContext soon;
  soon.deadline = clock_.Now() + absl::Microseconds(10);
  soon.observer = &observer;
  Reply* a = Submit({"a"}, 0, soon);
  clock_.Advance(absl::Microseconds(10));
  queue_->Poll();
  EXPECT_EQ(a->result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(observer.starts, 0);
}

TEST_F(BatcherTest, CallsNamingTheSameSequenceGoInSeparateBatchesInArrivalOrder) {
  Make(DecodeBatcherOptions());
  Submit({"z"});  // in flight
  Reply* a1 = Submit({"a"});
  Reply* b = Submit({"b"});
  Reply* a2 = Submit({"c", "a"});
  Reply* d = Submit({"d"});
  Reply* a3 = Submit({"a"});
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("z", "a,b", "c,a,d", "a"));
  EXPECT_EQ(a1->Summary(), "a@1");
  EXPECT_EQ(b->Summary(), "b@1");
  EXPECT_EQ(a2->Summary(), "c@1,a@2");
  EXPECT_EQ(d->Summary(), "d@1");
  EXPECT_EQ(a3->Summary(), "a@3");
}

// With two slots per layer, a call naming a sequence of the batch in flight still waits for it
// (and, FIFO, so does everything behind it).
TEST_F(BatcherTest, ASequenceInFlightHoldsItsNextCallEvenWithAFreeSlot) {
  DecodeBatcherOptions o;
  o.max_inflight_batches = 2;
  Make(o);
  Submit({"a"});  // slot 1
  Reply* a2 = Submit({"a"});
  Submit({"b"});
  EXPECT_EQ(dispatcher_.held.size(), 1u);
  EXPECT_EQ(queue_->NextWakeup(), absl::InfiniteFuture());  // nothing to do until a finishes
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a", "a,b"));
  EXPECT_EQ(a2->Summary(), "a@2");
}

TEST_F(BatcherTest, ShutdownFlushesQueuedCallsWhichRunToCompletion) {
  Make(NoSizeFlush(absl::Seconds(10)));
  Submit({"a"});  // waits for its delay
  Reply* b = Submit({"b"});
  queue_->Shutdown();
  EXPECT_EQ(dispatcher_.held.size(), 1u);  // flushed at once, no time passed
  Reply* late = Submit({"c"});
  EXPECT_EQ(last_submit_.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(last_submit_.message(), "the server is shutting down");
  EXPECT_FALSE(late->called);  // done is never called for a refused Submit
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a,b"));
  EXPECT_EQ(b->Summary(), "b@1");
}

TEST_F(BatcherTest, ShutdownRunsCallsQueuedBehindABatchInFlight) {
  DecodeBatcherOptions o = NoSizeFlush(absl::Seconds(10));
  o.flush_batch_sizes = {1};
  Make(o);
  Submit({"a"});  // in flight (held by the dispatcher)
  Submit({"b"});
  queue_->Shutdown();
  dispatcher_.refuse = absl::UnavailableError("the server is shutting down");
  dispatcher_.RunAll();  // b runs on a's worker after a, without a new dispatch
  EXPECT_THAT(exec_.Batches(), ElementsAre("a", "b"));
  for (const Reply& r : replies_) EXPECT_TRUE(r.result.ok()) << r.Summary();
}

TEST_F(BatcherTest, ARefusedDispatchFailsOnlyThatBatch) {
  Make(NoSizeFlush(absl::ZeroDuration()));
  dispatcher_.refuse = absl::ResourceExhaustedError("the request queue is full");
  Reply* a = Submit({"a"});
  EXPECT_TRUE(last_submit_.ok());
  EXPECT_EQ(a->result.status().code(), absl::StatusCode::kResourceExhausted);
  dispatcher_.refuse = absl::OkStatus();
  Reply* b = Submit({"b"});  // the slot was given back
  dispatcher_.RunAll();
  EXPECT_EQ(b->Summary(), "b@1");
}

TEST_F(BatcherTest, RefusesBeyondTheQueueLimit) {
  DecodeBatcherOptions o = NoSizeFlush();
  o.max_queued_calls = 2;
  Make(o);
  Submit({"a"});
  Submit({"b"});
  Reply* c = Submit({"c"});
  EXPECT_EQ(last_submit_.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(last_submit_.message(),
            "the decode batch queue is full (2 calls waiting); retry later");
  EXPECT_FALSE(c->called);
}

TEST_F(BatcherTest, AnEmptyCallRunsAlone) {
  Make(NoSizeFlush());
  Submit({"a"});
  Reply* empty = Submit({});
  Submit({"b"});
  clock_.Advance(absl::Microseconds(100));
  queue_->Poll();
  dispatcher_.RunAll();
  clock_.Advance(absl::Microseconds(100));
  queue_->Poll();
  dispatcher_.RunAll();
  EXPECT_THAT(exec_.Batches(), ElementsAre("a", "", "b"));
  EXPECT_EQ(empty->result.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(BatcherTest, CountsWhatTheEngineRan) {
  // The batcher flushes at the sizes and sums what the executor says it ran (a graph engine's
  // replays and padding); it pads nothing itself.
  exec_.replay_graphs = true;
  DecodeBatcherOptions o;
  o.flush_batch_sizes = {1, 2, 4, 8};
  o.max_queue_delay = absl::ZeroDuration();
  o.max_decode_batch = 16;
  std::vector<int64_t> observed;
  int observed_replays = 0;
  int64_t observed_padding = 0;
  o.on_batch = [&](int64_t n, const DecodeStats& ran) {
    observed.push_back(n);
    observed_replays += ran.graph_replays;
    observed_padding += ran.padding_entries;
  };
  Make(o);
  Submit({"a"});  // in flight
  Submit({"b", "c", "d"});
  Submit({"e", "f"});  // batch of 5: the engine pads it to 8
  dispatcher_.RunAll();
  Submit({"g", "h", "i", "j", "k", "l", "m", "n", "o"});  // 9: past 8, eager
  dispatcher_.RunAll();
  ASSERT_EQ(exec_.launches.size(), 3u);
  DecodeBatchingStats s = queue_->Stats();
  EXPECT_EQ(s.padding_entries, 3);
  EXPECT_EQ(s.graph_replays, 2);
  EXPECT_EQ(s.eager_launches, 1);
  EXPECT_EQ(s.batches_by_size, (std::map<int32_t, int64_t>{{1, 1}, {5, 1}, {9, 1}}));
  EXPECT_THAT(observed, ElementsAre(1, 5, 9));
  EXPECT_EQ(observed_replays, 2);
  EXPECT_EQ(observed_padding, 3);

  // An engine that replays nothing (the CPU, --disable-cuda-graphs): the sizes still flush.
  exec_.replay_graphs = false;
  Make(o);
  exec_.launches.clear();
  Submit({"p"});
  Submit({"q", "r", "s"});
  dispatcher_.RunAll();
  ASSERT_EQ(exec_.launches.size(), 2u);
  s = queue_->Stats();
  EXPECT_EQ(s.padding_entries, 0);
  EXPECT_EQ(s.graph_replays, 0);
  EXPECT_EQ(s.eager_launches, 2);
}

// The timer thread (real clock) launches a batch whose delay expires with no further call.
TEST(BatcherTimerTest, TheTimerFlushesAnExpiredDelay) {
  FakeExecutor exec;
  DecodeBatcherOptions o = NoSizeFlush(absl::Milliseconds(2));
  Notification done;
  auto q = BatchingDecodeQueue::Create(
      o, &exec,
      [](std::function<void()> f) {
        f();
        return absl::OkStatus();
      },
      Clock::Real(),
      /*start_timer=*/true);
  ASSERT_TRUE(q.ok()) << q.status();
  DecodeCall call;
  call.entries.emplace_back();
  call.entries[0].sequence_id = "a";
  absl::StatusOr<DecodeResult> got = absl::UnknownError("not answered");
  ASSERT_TRUE((*q)->Submit(std::move(call),
                           [&](absl::StatusOr<DecodeResult> r) {
                             got = std::move(r);
                             done.Notify();
                           })
                  .ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->outputs[0].out, "a@1");
}

// Many threads, a real worker pool and the real clock with the timer on: the outcome is checked
// only through invariants that hold under any interleaving: every call is answered exactly once
// with its own outputs, no sequence is ever in two concurrently running batches of one layer, and
// each sequence's length counts exactly its calls (in each thread's submission order).
class CheckingExecutor : public DecodeExecutor {
 public:
  absl::StatusOr<DecodeResult> Decode(const DecodeCall& call) override {
    std::vector<std::pair<int32_t, std::string>> keys;
    {
      MutexLock lock(&mu_);
      for (const auto& e : call.entries) {
        keys.emplace_back(call.layer, std::string(e.sequence_id));
        if (!busy_.insert(keys.back()).second) ++overlaps_;
      }
      ++launches_;
      max_batch_ = std::max<int64_t>(max_batch_, call.entries.size());
    }
    std::this_thread::yield();
    DecodeResult result;
    MutexLock lock(&mu_);
    for (const auto& k : keys) {
      busy_.erase(k);
      DecodeResult::Output o;
      o.length = ++lengths_[k];
      o.out = k.second;
      result.outputs.push_back(std::move(o));
    }
    return result;
  }
  Mutex mu_;
  std::set<std::pair<int32_t, std::string>> busy_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<int32_t, std::string>, int64_t> lengths_ ABSL_GUARDED_BY(mu_);
  int64_t overlaps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t launches_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t max_batch_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(BatcherStressTest, ConcurrentSubmittersKeepEveryInvariant) {
  CheckingExecutor exec;
  WorkQueueOptions wo;
  wo.num_workers = 4;
  WorkQueue workers(wo);
  DecodeBatcherOptions o;
  o.max_decode_batch = 16;
  o.max_queue_delay = absl::Microseconds(50);
  o.max_inflight_batches = 2;
  auto q = BatchingDecodeQueue::Create(
      o, &exec, [&workers](std::function<void()> f) { return workers.Submit(std::move(f)); },
      Clock::Real(), /*start_timer=*/true);
  ASSERT_TRUE(q.ok()) << q.status();
  constexpr int kThreads = 8, kCalls = 300;
  // Thread t uses sequences "s<t>" and "shared<t % 2>" (shared with other threads).
  std::vector<std::string> own(kThreads), shared = {"shared0", "shared1"};
  for (int t = 0; t < kThreads; ++t) own[t] = absl::StrCat("s", t);
  std::atomic<int64_t> answers{0}, wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      int64_t last_own_len[2] = {0, 0};
      for (int i = 0; i < kCalls; ++i) {
        const int32_t layer = static_cast<int32_t>(rng() % 2);
        DecodeCall call;
        call.layer = layer;
        call.entries.resize(rng() % 3 == 0 ? 2 : 1);
        call.entries[0].sequence_id = own[t];
        if (call.entries.size() == 2) call.entries[1].sequence_id = shared[t % 2];
        const size_t n = call.entries.size();
        Notification done;
        absl::StatusOr<DecodeResult> got = absl::UnknownError("pending");
        absl::Status s = (*q)->Submit(std::move(call), [&](absl::StatusOr<DecodeResult> r) {
          got = std::move(r);
          answers.fetch_add(1);
          done.Notify();
        });
        if (!s.ok()) {
          wrong.fetch_add(1);
          continue;
        }
        done.WaitForNotification();
        // Each thread's own sequence advances by exactly one per call, in submission order.
        if (!got.ok() || got->outputs.size() != n || got->outputs[0].out != own[t] ||
            got->outputs[0].length != ++last_own_len[layer]) {
          wrong.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  (*q)->Shutdown();
  workers.Shutdown();
  EXPECT_EQ(answers.load(), kThreads * kCalls);
  EXPECT_EQ(wrong.load(), 0);
  MutexLock lock(&exec.mu_);
  EXPECT_EQ(exec.overlaps_, 0);
  int64_t total = 0;
  for (const auto& [key, len] : exec.lengths_) total += len;
  const DecodeBatchingStats st = (*q)->Stats();
  EXPECT_EQ(total, st.entries);
  EXPECT_EQ(st.calls_completed, kThreads * kCalls);
  EXPECT_EQ(st.queued_calls, 0);
  EXPECT_EQ(st.inflight_batches, 0);
  EXPECT_LE(exec.max_batch_, 16);
}

// ---- Through the real Runtime + CPU engine ----

constexpr int kHq = 4, kHkv = 2, kD = 64;

using test_models::RandomFloats;
using test_models::TinyModel;

absl::string_view Bytes(const std::vector<float>& v) {
  return absl::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

class RuntimeBatchingTest : public testing::Test {
 protected:
  void SetUp() override {
    EngineOptions eo;
    eo.device = "cpu";
    eo.geometry = TinyModel().geometry();
    eo.num_layers = 2;
    eo.page_size = 16;
    eo.kv_cache_bytes = 256 * 32768;  // 256 pages of 16 tokens
    eo.compute_threads = 2;
    absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    RuntimeOptions ro;
    ro.max_sequence_length = 512;
    absl::StatusOr<std::unique_ptr<Runtime>> rt =
        Runtime::Create(TinyModel(), *std::move(engine), ro);
    ASSERT_TRUE(rt.ok()) << rt.status();
    runtime_ = *std::move(rt);
    executor_ = std::make_unique<RuntimeDecodeExecutor>(runtime_.get());
  }

  // A sequence with `prompt` tokens prefilled in layer 0, mirrored in a naive reference.
  std::string NewSequence(int64_t prompt, std::mt19937* rng) {
    absl::StatusOr<std::string> id = runtime_->CreateSequence("");
    EXPECT_TRUE(id.ok());
    std::vector<float> q = RandomFloats(prompt * 5 * kHq * kD, rng);
    std::vector<float> k = RandomFloats(prompt * kHkv * kD, rng);
    std::vector<float> v = RandomFloats(prompt * kHkv * kD, rng);
    const std::vector<int64_t> qs = {prompt, 5, kHq, kD}, ks = {prompt, kHkv, kD};
    PrefillCall call;
    call.sequence_id = *id;
    call.q = RequestTensor{DType::kFp32, qs, Bytes(q)};
    call.k = RequestTensor{DType::kFp32, ks, Bytes(k)};
    call.v = RequestTensor{DType::kFp32, ks, Bytes(v)};
    EXPECT_TRUE(runtime_->Prefill(call).ok());
    auto ref = std::make_unique<naive::NaiveSequence>(TinyModel().geometry(), 2);
    EXPECT_TRUE(ref->Prefill(0, q, k, v, prompt).ok());
    refs_[*id] = std::move(ref);
    return *id;
  }

  std::unique_ptr<Runtime> runtime_;
  std::unique_ptr<RuntimeDecodeExecutor> executor_;
  std::map<std::string, std::unique_ptr<naive::NaiveSequence>> refs_;
};

// Batch-1 calls from 8 "clients" (plus one bad call) merge into one runtime batch; every output
// matches the fp64 reference and the bad call fails alone with the runtime's own message.
TEST_F(RuntimeBatchingTest, MergedBatchMatchesTheReferenceAndIsolatesABadCall) {
  std::mt19937 rng(7);
  ManualClock clock;
  HeldDispatcher dispatcher;
  DecodeBatcherOptions o = NoSizeFlush();
  auto q = BatchingDecodeQueue::Create(o, executor_.get(), dispatcher.fn(), &clock, false);
  ASSERT_TRUE(q.ok());
  constexpr int kClients = 8;
  std::vector<std::string> ids;
  for (int i = 0; i < kClients; ++i) ids.push_back(NewSequence(100 + 37 * i, &rng));
  struct Client {
    std::vector<float> q, k, v;
    absl::StatusOr<DecodeResult> got = absl::UnknownError("pending");
  };
  std::vector<Client> clients(kClients + 1);
  const std::vector<int64_t> qs = {3, kHq, kD}, ks = {kHkv, kD};
  const std::string unknown(32, 'f');
  for (int i = 0; i <= kClients; ++i) {
    Client& c = clients[i];
    c.q = RandomFloats(3 * kHq * kD, &rng);
    c.k = RandomFloats(kHkv * kD, &rng);
    c.v = RandomFloats(kHkv * kD, &rng);
    DecodeCall call;
    call.entries.emplace_back();
    DecodeCall::Entry& e = call.entries[0];
    e.sequence_id = i < kClients ? absl::string_view(ids[i]) : absl::string_view(unknown);
    e.q = RequestTensor{DType::kFp32, qs, Bytes(c.q)};
    e.k = RequestTensor{DType::kFp32, ks, Bytes(c.k)};
    e.v = RequestTensor{DType::kFp32, ks, Bytes(c.v)};
    ASSERT_TRUE((*q)->Submit(std::move(call),
                             [&c](absl::StatusOr<DecodeResult> r) { c.got = std::move(r); })
                    .ok());
  }
  clock.Advance(absl::Microseconds(100));
  (*q)->Poll();
  dispatcher.RunAll();
  const DecodeBatchingStats s = (*q)->Stats();
  EXPECT_EQ(s.batches_by_size, (std::map<int32_t, int64_t>{{kClients + 1, 1}}));
  EXPECT_EQ(s.split_retries, 1);
  EXPECT_EQ(clients[kClients].got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(clients[kClients].got.status().message(),
            absl::StrCat("entries[0]: sequence ", unknown, " not found"));
  for (int i = 0; i < kClients; ++i) {
    Client& c = clients[i];
    ASSERT_TRUE(c.got.ok()) << i << ": " << c.got.status();
    ASSERT_EQ(c.got->outputs.size(), 1u);
    const DecodeResult::Output& out = c.got->outputs[0];
    EXPECT_EQ(out.length, 100 + 37 * i + 1);
    absl::StatusOr<std::vector<float>> want = refs_[ids[i]]->Decode(0, c.q, c.k, c.v);
    ASSERT_TRUE(want.ok());
    ASSERT_EQ(out.out.size(), want->size() * sizeof(float));
    const float* got = reinterpret_cast<const float*>(out.out.data());
    for (size_t j = 0; j < want->size(); ++j) {
      ASSERT_NEAR(got[j], (*want)[j], 2e-5 + 2e-5 * std::abs((*want)[j])) << i << " at " << j;
    }
    // Decoded exactly once (the failed merged attempt changed nothing).
    EXPECT_EQ((*runtime_->LayerLengths(ids[i], ""))[0], 100 + 37 * i + 1);
  }
}

}  // namespace
}  // namespace attnd
