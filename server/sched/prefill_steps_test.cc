// Prefill calls as device steps, through the Runtime and the CPU engine: a call cut into many steps
// writes the same output and K/V bit for bit as one step; a call stopped (cancel, deadline) or
// failed at step N changes nothing; and under the StepScheduler decodes of other sequences run
// between the steps of a long prefill.
#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/mutex.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "server/config/model_config.h"
#include "server/config/test_models.h"
#include "server/engine/engine.h"
#include "server/engine/engine_factory.h"
#include "server/engine/prefill_step_hook_for_testing.h"
#include "server/runtime/device_turns.h"
#include "server/runtime/runtime.h"
#include "server/sched/step_scheduler.h"

namespace attnd {
namespace {

using test_models::TinyModel;
constexpr int kHq = 4, kHkv = 2, kD = 64;

// Counts the prefill steps of the engine it is given to, and fails the step numbered fail_at
// (0-based, over every run) with DATA_LOSS: a device error in the middle of a call, after the steps
// before it reached the real engine.
struct StepCounter {
  std::atomic<int64_t> steps{0};
  std::atomic<int64_t> fail_at{-1};
};

// Records the order in which turns were admitted, around a real scheduler.
class RecordingTurns : public DeviceTurns {
 public:
  explicit RecordingTurns(std::shared_ptr<DeviceTurns> inner) : inner_(std::move(inner)) {}
  void Acquire(DeviceWork work) override {
    inner_->Acquire(work);
    MutexLock lock(&mu_);
    order_.push_back(work == DeviceWork::kDecode ? 'd' : 'p');
  }
  void Release(DeviceWork work) override { inner_->Release(work); }
  std::string order() const {
    MutexLock lock(&mu_);
    return order_;
  }

 private:
  const std::shared_ptr<DeviceTurns> inner_;
  mutable Mutex mu_;
  std::string order_ ABSL_GUARDED_BY(mu_);
};

struct Tensors {
  std::vector<float> q, k, v;
  int64_t t = 0;
};

Tensors RandomTensors(int64_t t, std::mt19937* rng) {
  Tensors x;
  x.t = t;
  x.q = test_models::RandomFloats(t * kNumQueryVariants * kHq * kD, rng);
  x.k = test_models::RandomFloats(t * kHkv * kD, rng);
  x.v = test_models::RandomFloats(t * kHkv * kD, rng);
  return x;
}

RequestTensor View(const std::vector<float>& data, std::vector<int64_t>* shape) {
  RequestTensor r;
  r.dtype = DType::kFp32;
  r.shape = *shape;
  r.bytes = absl::string_view(reinterpret_cast<const char*>(data.data()), data.size() * 4);
  return r;
}

class PrefillStepsTest : public testing::Test {
 protected:
  // A runtime over the CPU engine; step_keys 1: every query row is a step of its own.
  std::unique_ptr<Runtime> Make(int64_t step_keys, std::shared_ptr<DeviceTurns> turns = nullptr,
                                StepCounter* counter = nullptr) {
    EngineOptions eo;
    eo.device = "cpu";
    eo.geometry = TinyModel().geometry();
    eo.num_layers = 2;
    eo.page_size = 16;
    eo.kv_cache_bytes = int64_t{64} << 20;
    eo.compute_threads = 2;
    eo.prefill_step_keys = step_keys;
    absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(eo);
    EXPECT_TRUE(engine.ok()) << engine.status();
    auto wrapped =
        std::make_unique<PrefillStepHook>(*std::move(engine), [counter]() -> absl::Status {
          if (counter != nullptr && counter->steps.fetch_add(1) == counter->fail_at.load()) {
            return absl::DataLossError("injected at a step");
          }
          return absl::OkStatus();
        });
    RuntimeOptions ro;
    ro.max_sequence_length = 4096;
    ro.device_turns = std::move(turns);
    absl::StatusOr<std::unique_ptr<Runtime>> rt =
        Runtime::Create(TinyModel(), std::move(wrapped), ro);
    EXPECT_TRUE(rt.ok()) << rt.status();
    return rt.ok() ? *std::move(rt) : nullptr;
  }

  // Prefills x into layer 0 of `id`; the output as raw bytes.
  absl::StatusOr<std::string> Prefill(Runtime* rt, const std::string& id, const Tensors& x,
                                      std::function<absl::Status()> keep_going = nullptr) {
    std::vector<int64_t> qs = {x.t, kNumQueryVariants, kHq, kD}, ks = {x.t, kHkv, kD};
    PrefillCall call;
    call.sequence_id = id;
    call.layer = 0;
    call.q = View(x.q, &qs);
    call.k = View(x.k, &ks);
    call.v = View(x.v, &ks);
    call.keep_going = std::move(keep_going);
    absl::StatusOr<PrefillResult> r = rt->Prefill(call);
    if (!r.ok()) return r.status();
    return r->out;
  }

  // One decode step on layer 0 of `id` (reads the whole layer's K/V); the output as raw bytes.
  absl::StatusOr<std::string> Decode(Runtime* rt, const std::string& id, const Tensors& x) {
    std::vector<int64_t> qs = {kNumQueryVariants, kHq, kD}, ks = {kHkv, kD};
    DecodeCall call;
    call.layer = 0;
    DecodeCall::Entry e;
    e.sequence_id = id;
    e.q = View(x.q, &qs);
    e.k = View(x.k, &ks);
    e.v = View(x.v, &ks);
    call.entries.push_back(e);
    absl::StatusOr<DecodeResult> r = rt->Decode(call);
    if (!r.ok()) return r.status();
    return r->outputs[0].out;
  }

  std::mt19937 rng_{7};
};

// 300 tokens span three DCA chunks (chunk_len 128) of the tiny model; with step_keys 1 every row is
// a step, so rows of one piece and pieces are split across steps everywhere.
TEST_F(PrefillStepsTest, ManyStepsEqualOneStepBitForBit) {
  std::unique_ptr<Runtime> one = Make(int64_t{1} << 40), many = Make(1);
  StepCounter counted;
  std::unique_ptr<Runtime> counting = Make(1, nullptr, &counted);
  const Tensors first = RandomTensors(300, &rng_), second = RandomTensors(45, &rng_);
  const Tensors token = RandomTensors(1, &rng_);
  const std::string a = *one->CreateSequence(""), b = *many->CreateSequence("");
  const std::string c = *counting->CreateSequence("");
  for (const Tensors* x : {&first, &second}) {  // the second call starts at 300
    absl::StatusOr<std::string> out_one = Prefill(one.get(), a, *x);
    absl::StatusOr<std::string> out_many = Prefill(many.get(), b, *x);
    ASSERT_TRUE(out_one.ok()) << out_one.status();
    ASSERT_TRUE(out_many.ok()) << out_many.status();
    ASSERT_EQ(out_one->size(), out_many->size());
    EXPECT_EQ(std::memcmp(out_one->data(), out_many->data(), out_one->size()), 0);
  }
  // The K/V both wrote: a decode reads all of it.
  absl::StatusOr<std::string> d_one = Decode(one.get(), a, token);
  absl::StatusOr<std::string> d_many = Decode(many.get(), b, token);
  ASSERT_TRUE(d_one.ok() && d_many.ok());
  EXPECT_EQ(*d_one, *d_many);
  // And the call really ran as steps: one to stage, then one per row.
  ASSERT_TRUE(Prefill(counting.get(), c, first).ok());
  EXPECT_EQ(counted.steps.load(), 1 + 300);
}

TEST_F(PrefillStepsTest, AStopBetweenStepsChangesNothingAndTheRetryMatches) {
  std::unique_ptr<Runtime> rt = Make(1), reference = Make(1);
  const Tensors x = RandomTensors(200, &rng_);
  const std::string id = *rt->CreateSequence(""), ref = *reference->CreateSequence("");
  const int64_t free_before = rt->Info().kv_cache.pages_free;
  int asked = 0;
  absl::StatusOr<std::string> stopped = Prefill(rt.get(), id, x, [&]() -> absl::Status {
    return ++asked > 5 ? absl::CancelledError("client gone") : absl::OkStatus();
  });
  ASSERT_FALSE(stopped.ok());
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(asked, 6);  // asked before every step, stopped before the sixth
  EXPECT_EQ((*rt->LayerLengths(id, ""))[0], 0);
  EXPECT_EQ(rt->Info().kv_cache.pages_free, free_before);
  absl::StatusOr<std::string> retry = Prefill(rt.get(), id, x);
  absl::StatusOr<std::string> expected = Prefill(reference.get(), ref, x);
  ASSERT_TRUE(retry.ok() && expected.ok());
  EXPECT_EQ(*retry, *expected);
  EXPECT_EQ((*rt->LayerLengths(id, ""))[0], 200);
}

TEST_F(PrefillStepsTest, AFailureAtStepNChangesNothingAndTheRetryMatches) {
  StepCounter failing;
  std::unique_ptr<Runtime> rt = Make(1, nullptr, &failing), reference = Make(1);
  const Tensors x = RandomTensors(150, &rng_), more = RandomTensors(20, &rng_);
  const std::string id = *rt->CreateSequence(""), ref = *reference->CreateSequence("");
  ASSERT_TRUE(Prefill(rt.get(), id, x).ok());
  ASSERT_TRUE(Prefill(reference.get(), ref, x).ok());
  const int64_t free_before = rt->Info().kv_cache.pages_free;
  failing.fail_at = failing.steps.load() + 7;  // the staging step and six rows ran
  absl::StatusOr<std::string> failed = Prefill(rt.get(), id, more);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_EQ((*rt->LayerLengths(id, ""))[0], 150);
  EXPECT_EQ(rt->Info().kv_cache.pages_free, free_before);
  absl::StatusOr<std::string> retry = Prefill(rt.get(), id, more);
  absl::StatusOr<std::string> expected = Prefill(reference.get(), ref, more);
  ASSERT_TRUE(retry.ok() && expected.ok()) << retry.status();
  EXPECT_EQ(*retry, *expected);
}

// Alternating turns: a decoder loops on one sequence while another is prefilled in 401 steps; the
// decodes run between the prefill's steps, and both finish.
TEST_F(PrefillStepsTest, DecodesRunBetweenTheStepsOfALongPrefill) {
  StepSchedulerOptions so;
  so.overlap = false;
  auto turns = std::make_shared<RecordingTurns>(std::make_shared<StepScheduler>(so));
  std::unique_ptr<Runtime> rt = Make(1, turns);
  const std::string decoding = *rt->CreateSequence(""), prefilling = *rt->CreateSequence("");
  ASSERT_TRUE(Prefill(rt.get(), decoding, RandomTensors(64, &rng_)).ok());
  const Tensors long_prompt = RandomTensors(400, &rng_), token = RandomTensors(1, &rng_);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> decodes{0};
  std::thread decoder([&] {
    while (!stop.load()) {
      ASSERT_TRUE(Decode(rt.get(), decoding, token).ok());
      ++decodes;
    }
  });
  while (decodes.load() == 0) std::this_thread::yield();
  ASSERT_TRUE(Prefill(rt.get(), prefilling, long_prompt).ok());
  stop = true;
  decoder.join();
  const std::string order = turns->order();
  const size_t first_p = order.find('p', order.find('p') + 1);  // the long call's first step
  const size_t last_p = order.rfind('p');
  ASSERT_NE(first_p, std::string::npos);
  const int64_t between = std::count(order.begin() + first_p, order.begin() + last_p, 'd');
  EXPECT_GT(between, 0) << "no decode ran inside the prefill call: " << order.size() << " turns";
  EXPECT_EQ((*rt->LayerLengths(prefilling, ""))[0], 400);
}

}  // namespace
}  // namespace attnd
