// DirectDecodeQueue: runs a decode on a worker and reports through `done` exactly once; refuses
// (and never calls done) once the work queue stops accepting.
#include "server/sched/decode_queue.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/dtype.h"
#include "base/mutex.h"
#include "gtest/gtest.h"
#include "server/config/model_config.h"
#include "server/config/test_models.h"
#include "server/engine/engine_factory.h"
#include "server/runtime/runtime.h"
#include "server/sched/request_context.h"
#include "server/sched/work_queue.h"

namespace attnd {
namespace {

using test_models::TinyModel;

std::unique_ptr<Runtime> MakeRuntime() {
  EngineOptions eo;
  eo.device = "cpu";
  eo.geometry = TinyModel().geometry();
  eo.num_layers = 2;
  eo.page_size = 16;
  eo.kv_cache_bytes = 8 * 32768;
  eo.compute_threads = 1;
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(eo);
  EXPECT_TRUE(engine.ok()) << engine.status();
  absl::StatusOr<std::unique_ptr<Runtime>> rt =
      Runtime::Create(TinyModel(), *std::move(engine), RuntimeOptions());
  EXPECT_TRUE(rt.ok()) << rt.status();
  return *std::move(rt);
}

// Constant tensors: with one cached token whose value is 0.5 everywhere, attention over it returns
// that value exactly, whatever the query.
std::string Filled(int64_t n, float value) {
  std::vector<float> v(n, value);
  return std::string(reinterpret_cast<const char*>(v.data()), n * sizeof(float));
}

TEST(DirectDecodeQueueTest, RunsOnAWorkerAndReportsOnce) {
  std::unique_ptr<Runtime> rt = MakeRuntime();
  absl::StatusOr<std::string> id = rt->CreateSequence("");
  ASSERT_TRUE(id.ok());
  const std::vector<int64_t> pq = {1, 5, 4, 64}, pkv = {1, 2, 64};
  const std::string q = Filled(5 * 4 * 64, 0.1f), kv = Filled(2 * 64, 0.5f);
  PrefillCall prefill;
  prefill.sequence_id = *id;
  prefill.q = {DType::kFp32, pq, q};
  prefill.k = prefill.v = {DType::kFp32, pkv, kv};
  ASSERT_TRUE(rt->Prefill(prefill).ok());

  WorkQueueOptions wo;
  wo.num_workers = 1;
  WorkQueue work(wo);
  DirectDecodeQueue queue(rt.get(), &work);
  const std::vector<int64_t> dq = {3, 4, 64}, dkv = {2, 64};
  const std::string q3 = Filled(3 * 4 * 64, 0.2f);
  DecodeCall call;
  call.layer = 0;
  call.entries.push_back(
      {*id, {DType::kFp32, dq, q3}, {DType::kFp32, dkv, kv}, {DType::kFp32, dkv, kv}, nullptr});
  Notification done;
  int calls = 0;
  std::thread::id ran_on;
  absl::StatusOr<DecodeResult> got = absl::UnknownError("not called");
  ASSERT_TRUE(queue
                  .Submit(call,
                          [&](absl::StatusOr<DecodeResult> r) {
                            ++calls;
                            ran_on = std::this_thread::get_id();
                            got = std::move(r);
                            done.Notify();
                          })
                  .ok());
  done.WaitForNotification();
  work.Shutdown();
  EXPECT_EQ(calls, 1);
  EXPECT_NE(ran_on, std::this_thread::get_id());
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->outputs.size(), 1u);
  EXPECT_EQ(got->outputs[0].length, 2);
  std::vector<float> out(4 * 64);
  ConvertToFloat(got->outputs[0].out.data(), DType::kFp32, out.size(), out.data());
  for (float x : out) ASSERT_FLOAT_EQ(x, 0.5f);  // both cached values are 0.5
}

TEST(DirectDecodeQueueTest, RefusesWhenTheWorkQueueStopped) {
  std::unique_ptr<Runtime> rt = MakeRuntime();
  WorkQueue work(WorkQueueOptions{});
  DirectDecodeQueue queue(rt.get(), &work);
  work.StopAccepting();
  bool called = false;
  absl::Status s = queue.Submit(DecodeCall(), [&](absl::StatusOr<DecodeResult>) { called = true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "the server is shutting down");
  work.Shutdown();
  EXPECT_FALSE(called);
}

// The worker that dequeues a decode checks its context first: a call whose deadline passed, or
// that was cancelled, while it waited is answered without reaching the runtime (the sequence is
// left as it was).
TEST(DirectDecodeQueueTest, AnExpiredOrCancelledCallIsAnsweredWithoutRunning) {
  std::unique_ptr<Runtime> rt = MakeRuntime();
  absl::StatusOr<std::string> id = rt->CreateSequence("");
  ASSERT_TRUE(id.ok());
  const std::vector<int64_t> pq = {1, 5, 4, 64}, pkv = {1, 2, 64};
  const std::string q = Filled(5 * 4 * 64, 0.1f), kv = Filled(2 * 64, 0.5f);
  PrefillCall prefill;
  prefill.sequence_id = *id;
  prefill.q = {DType::kFp32, pq, q};
  prefill.k = prefill.v = {DType::kFp32, pkv, kv};
  ASSERT_TRUE(rt->Prefill(prefill).ok());

  WorkQueueOptions wo;
  wo.num_workers = 1;
  WorkQueue work(wo);
  DirectDecodeQueue queue(rt.get(), &work);
  const std::vector<int64_t> dq = {3, 4, 64}, dkv = {2, 64};
  const std::string q3 = Filled(3 * 4 * 64, 0.2f);
  DecodeCall call;
  call.layer = 0;
  call.entries.push_back(
      {*id, {DType::kFp32, dq, q3}, {DType::kFp32, dkv, kv}, {DType::kFp32, dkv, kv}, nullptr});

  RequestContext expired;
  expired.deadline = absl::InfinitePast();
  std::shared_ptr<std::atomic<bool>> cancel = NewCancelFlag();
  cancel->store(true);
  RequestContext cancelled;
  cancelled.cancelled = cancel;
  Mutex mu;
  std::vector<absl::StatusCode> codes;
  for (const RequestContext* c : {&expired, &cancelled}) {
    Notification done;
    ASSERT_TRUE(queue
                    .Submit(call, *c,
                            [&](absl::StatusOr<DecodeResult> r) {
                              MutexLock lock(&mu);
                              codes.push_back(r.status().code());
                              done.Notify();
                            })
                    .ok());
    done.WaitForNotification();
  }
  work.Shutdown();
  MutexLock lock(&mu);
  EXPECT_EQ(codes, (std::vector<absl::StatusCode>{absl::StatusCode::kDeadlineExceeded,
                                                  absl::StatusCode::kCancelled}));
  absl::StatusOr<std::vector<int64_t>> lengths = rt->LayerLengths(*id, "");
  ASSERT_TRUE(lengths.ok());
  EXPECT_EQ((*lengths)[0], 1);  // neither decode ran
}

}  // namespace
}  // namespace attnd
