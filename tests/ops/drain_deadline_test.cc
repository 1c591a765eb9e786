// Client deadlines and graceful drain against the real daemon. "Slow" work is a prefill held inside
// the engine (server/engine/fault_engine.h's gate) until the test releases it, on a server with one
// request worker, so later requests queue behind it however fast the machine is.
#include <atomic>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "gtest/gtest.h"
#include "server/engine/fault_engine.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace ops_testing {
namespace {

constexpr int64_t kSlowTokens = 256;

// Wraps the daemon's engine in a FaultEngine the test can gate; *gate is set at start-up.
void GateEngine(ServerOptions* options, FaultEngine** gate) {
  options->wrap_engine = [gate](std::unique_ptr<Engine> engine) -> std::unique_ptr<Engine> {
    auto wrapped = std::make_unique<FaultEngine>(std::move(engine));
    *gate = wrapped.get();
    return wrapped;
  };
}

// Waits until `n` prefills are held at the gate (so they occupy their request workers).
::testing::AssertionResult WaitForHeld(FaultEngine* gate, int64_t n) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (absl::Now() < give_up) {
    if (gate->held_prefills() >= n) return ::testing::AssertionSuccess();
    absl::SleepFor(absl::Milliseconds(2));
  }
  return ::testing::AssertionFailure() << gate->held_prefills() << " prefills held, not " << n;
}

struct Reply {
  grpc::Status status;
  int64_t length = 0;
  absl::Duration took;
};

// Starts a prefill on its own thread (own context, 60 s deadline).
std::future<Reply> PrefillAsync(v1::Attention::Stub* stub, v1::PrefillRequest req) {
  return std::async(std::launch::async, [stub, req = std::move(req)] {
    const absl::Time start = absl::Now();
    v1::PrefillResponse resp;
    auto ctx = Context("", std::chrono::seconds(60));
    Reply r;
    r.status = stub->Prefill(ctx.get(), req, &resp);
    r.length = resp.length();
    r.took = absl::Now() - start;
    return r;
  });
}

// Waits until `pages` KV pages are in use: a prefill allocates its pages on the worker right
// before computing, so this says the slow prefill holds the worker. GetServerInfo is answered on
// gRPC's thread, not by a worker.
::testing::AssertionResult WaitForPagesUsed(v1::Attention::Stub* stub, int64_t pages) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  int64_t used = -1;
  while (absl::Now() < give_up) {
    v1::GetServerInfoResponse info;
    auto ctx = Context();
    if (stub->GetServerInfo(ctx.get(), v1::GetServerInfoRequest(), &info).ok()) {
      used = info.kv_cache().pages_total() - info.kv_cache().pages_free();
      if (used >= pages) return ::testing::AssertionSuccess();
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return ::testing::AssertionFailure() << "pages used stayed at " << used << ", not " << pages;
}

std::string Metrics(Daemon& daemon) {
  return HttpGet(daemon.server().metrics_port(), "/metrics").value_or("");
}

TEST(OpsDeadlineTest, ExpiredRequestsQueuedBehindSlowWorkChangeNothing) {
  ServerOptions o = TinyOptions(512);
  o.request_workers = 1;
  FaultEngine* gate = nullptr;
  GateEngine(&o, &gate);
  // This test is about the work queue: with cross-RPC batching on, decodes queue in the batcher
  // instead (its own deadline tests are in server/sched/batcher_test.cc) and never wait behind a
  // prefill.
  o.decode_batching = false;
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  std::mt19937 rng(9);
  const std::string slow = MustCreate(stub.get());
  const std::string victim = MustCreate(stub.get());
  {
    v1::PrefillResponse resp;
    auto ctx = Context();
    ASSERT_TRUE(stub->Prefill(ctx.get(), MakePrefill(victim, 1, 8, &rng), &resp).ok());
    ASSERT_EQ(resp.length(), 8);
  }
  const v1::PrefillRequest victim_prefill = MakePrefill(victim, 0, 16, &rng);
  const v1::DecodeRequest victim_decode = MakeDecode(1, {victim}, &rng);

  gate->HoldPrefills();
  std::future<Reply> slow_reply = PrefillAsync(stub.get(), MakePrefill(slow, 0, kSlowTokens, &rng));
  // It holds the only worker now: victim's 1 page plus its 16 are allocated, and it waits at the
  // gate.
  ASSERT_TRUE(WaitForHeld(gate, 1));
  ASSERT_TRUE(WaitForPagesUsed(stub.get(), 1 + kSlowTokens / kPageSize));

  const absl::Time sent = absl::Now();
  v1::PrefillResponse presp;
  auto pctx = Context("", std::chrono::milliseconds(200));
  grpc::Status ps = stub->Prefill(pctx.get(), victim_prefill, &presp);
  v1::DecodeResponse dresp;
  auto dctx = Context("", std::chrono::milliseconds(200));
  grpc::Status ds = stub->Decode(dctx.get(), victim_decode, &dresp);
  EXPECT_EQ(ps.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << ps.error_message();
  EXPECT_EQ(ds.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << ds.error_message();
  // A third one, cancelled by its client while it waits.
  auto cctx = Context();
  const v1::PrefillRequest cancelled_prefill = MakePrefill(victim, 0, 8, &rng);
  std::future<grpc::Status> cancelled = std::async(std::launch::async, [&] {
    v1::PrefillResponse resp;
    return stub->Prefill(cctx.get(), cancelled_prefill, &resp);
  });
  absl::SleepFor(absl::Milliseconds(200));
  cctx->TryCancel();
  EXPECT_EQ(cancelled.get().error_code(), grpc::StatusCode::CANCELLED);
  // The client's status is local; the server learns of the cancel when the stream's reset
  // arrives. Released at once, the worker could reach the request first and run it (seen once
  // in CI on the loaded 2-core VM): give the reset time to land.
  absl::SleepFor(absl::Milliseconds(500));

  gate->ReleasePrefills();
  Reply r = slow_reply.get();
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.length, kSlowTokens);
  // The precondition of this test: the slow prefill outlived both short deadlines.
  ASSERT_GT(absl::Now() - sent, absl::Milliseconds(400))
      << "the slow prefill was too fast to queue anything behind it (" << r.took << ")";

  // The server answered both itself once a worker reached them, without running them.
  std::string m;
  for (int i = 0; i < 50; ++i) {  // the answers are recorded as the worker reaches them
    m = Metrics(daemon);
    if (SampleOr0(m, "attnd_requests_total{rpc=\"Prefill\",code=\"CANCELLED\"}") >= 1) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(SampleOr0(m, "attnd_requests_total{rpc=\"Prefill\",code=\"DEADLINE_EXCEEDED\"}"), 1);
  EXPECT_EQ(SampleOr0(m, "attnd_requests_total{rpc=\"Decode\",code=\"DEADLINE_EXCEEDED\"}"), 1);
  EXPECT_EQ(SampleOr0(m, "attnd_requests_total{rpc=\"Decode\",code=\"OK\"}"), 0);
  EXPECT_EQ(SampleOr0(m, "attnd_requests_total{rpc=\"Prefill\",code=\"CANCELLED\"}"), 1);
  EXPECT_EQ(SampleOr0(m, "attnd_requests_total{rpc=\"Prefill\",code=\"OK\"}"), 2);  // 8 + slow

  // Nothing changed: layer 0 is still empty, layer 1 still holds 8 tokens.
  v1::PrefillResponse resp;
  auto ctx = Context();
  ASSERT_TRUE(stub->Prefill(ctx.get(), MakePrefill(victim, 0, 4, &rng), &resp).ok());
  EXPECT_EQ(resp.length(), 4);
  auto ctx2 = Context();
  ASSERT_TRUE(stub->Decode(ctx2.get(), MakeDecode(1, {victim}, &rng), &dresp).ok());
  EXPECT_EQ(dresp.outputs(0).length(), 9);
}

TEST(OpsDrainTest, ShutdownFinishesInFlightWorkRefusesNewWorkAndReportsNotServing) {
  ServerOptions o = TinyOptions(512);
  o.request_workers = 2;
  o.health_listen = "127.0.0.1:0";
  FaultEngine* gate = nullptr;
  GateEngine(&o, &gate);
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  ASSERT_GT(daemon.server().health_port(), 0);
  auto health_channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", daemon.server().health_port()),
                          grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(health_channel, ""), 1);
  const int metrics_port = daemon.server().metrics_port();
  int http_status = 0;
  EXPECT_EQ(HttpGet(metrics_port, "/healthz", &http_status), "ok\n");
  EXPECT_EQ(http_status, 200);

  auto stub = daemon.Stub();
  std::mt19937 rng(13);
  const std::string slow = MustCreate(stub.get());
  gate->HoldPrefills();
  std::future<Reply> slow_reply = PrefillAsync(stub.get(), MakePrefill(slow, 0, kSlowTokens, &rng));
  ASSERT_TRUE(WaitForHeld(gate, 1));  // in flight, inside the engine

  // SIGTERM's path in main.cc.
  std::thread shutdown([&daemon] { daemon.server().Shutdown(absl::Now() + absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(HealthStatus(health_channel, ""), 2);  // NOT_SERVING while draining
  std::optional<std::string> healthz = HttpGet(metrics_port, "/healthz", &http_status);
  EXPECT_EQ(healthz, "not ready\n");
  EXPECT_EQ(http_status, 503);

  std::string id;
  grpc::Status s = Create(stub.get(), "", &id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_TRUE(id.empty());

  gate->ReleasePrefills();  // the in-flight prefill finishes during the drain
  Reply r = slow_reply.get();
  EXPECT_TRUE(r.status.ok()) << r.status.error_code() << " " << r.status.error_message();
  EXPECT_EQ(r.length, kSlowTokens);
  shutdown.join();
  daemon.server().Wait();
  // Everything is down afterwards: no metrics, no health.
  EXPECT_EQ(HttpGet(metrics_port, "/healthz"), std::nullopt);
  EXPECT_EQ(HealthStatus(health_channel, ""), -1);
}

// Under load, every call a drain touches ends OK or UNAVAILABLE with a message saying why: the
// calls in flight when SIGTERM comes and those sent just after it, until each client hears
// UNAVAILABLE (and, as a client of a fleet would, goes elsewhere). gRPC's own Shutdown cancels
// the calls it has received but not handed over (CANCELLED, no message), so attnd answers new
// calls itself until nothing is in flight, and only then shuts gRPC down.
TEST(OpsDrainTest, CallsDuringTheDrainEndOkOrUnavailableWithAMessage) {
  ServerOptions o = TinyOptions(4096);
  o.request_workers = 4;
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  constexpr int kClients = 48;
  std::atomic<bool> stop{false};
  std::atomic<int> shut{0};
  Mutex mu;
  std::vector<std::string> bad;
  int64_t calls = 0, after = 0;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      // A channel per client, as separate processes would have.
      auto stub = daemon.Stub();
      std::mt19937 rng(100 + c);
      std::string id;
      Create(stub.get(), "", &id);
      while (!stop.load()) {
        const bool late = shut.load() != 0;
        grpc::Status s;
        if (c % 2 == 0 && !id.empty()) {
          v1::PrefillResponse response;
          auto ctx = Context("", std::chrono::seconds(30));
          s = stub->Prefill(ctx.get(), MakePrefill(id, 0, 4, &rng), &response);
        } else {
          v1::GetServerInfoResponse info;
          auto ctx = Context();
          s = stub->GetServerInfo(ctx.get(), v1::GetServerInfoRequest(), &info);
        }
        MutexLock lock(&mu);
        ++calls;
        if (late) ++after;
        if (s.ok()) continue;
        if (s.error_code() != grpc::StatusCode::UNAVAILABLE || s.error_message().empty()) {
          bad.push_back(absl::StrCat(c % 2 == 0 ? "Prefill: " : "GetServerInfo: ", s.error_code(),
                                     " \"", s.error_message(), "\""));
        }
        return;  // a client told the server is going away goes elsewhere
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(500));
  shut.store(1);
  daemon.server().Shutdown(absl::Now() + absl::Seconds(20));
  daemon.server().Wait();
  stop.store(true);
  for (std::thread& t : clients) t.join();
  MutexLock lock(&mu);
  EXPECT_GT(calls, kClients);
  EXPECT_GT(after, 0);
  EXPECT_TRUE(bad.empty()) << bad.size() << " of " << calls << " calls, e.g. " << bad.front();
}

// The drain waits for the calls in flight, and only for them: a Prefill the fast path hands to
// protobuf (one with an output region) is done once answered, and does not hold the drain to its
// deadline.
TEST(OpsDrainTest, AnsweredCallsDoNotHoldTheDrain) {
  Daemon daemon(TinyOptions(64));
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  std::mt19937 rng(21);
  const std::string id = MustCreate(stub.get());
  v1::PrefillRequest request = MakePrefill(id, 0, 4, &rng);
  request.mutable_output_region()->set_region_id(std::string(32, 'a'));  // unknown: NOT_FOUND
  v1::PrefillResponse response;
  auto ctx = Context();
  EXPECT_EQ(stub->Prefill(ctx.get(), request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  const absl::Time start = absl::Now();
  daemon.server().Shutdown(start + absl::Seconds(20));
  daemon.server().Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace ops_testing
}  // namespace attnd
