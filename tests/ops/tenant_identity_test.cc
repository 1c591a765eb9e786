// The tenant belongs to the call, not to the connection (issue #13, item 1). Before the fix the
// token processor wrote the tenant into the connection's shared auth context: two tenants pooling
// one channel got each other's sequences, and concurrent calls on one authenticated connection
// crashed attnd (SIGSEGV in FindPropertyValues, SIGABRT in security_context.cc).
//
// ATTND_TENANT_TEST_SECONDS (default 3) sets how long each test hammers the daemon; the figures in
// docs/RELIABILITY.md come from runs of 60 s.
#include <atomic>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace ops_testing {
namespace {

const std::string& kTokenA = kTeamAToken;
const std::string& kTokenB = kTeamBToken;

absl::Duration TestDuration() {
  const char* s = std::getenv("ATTND_TENANT_TEST_SECONDS");
  return absl::Seconds(s != nullptr ? std::atof(s) : 3.0);
}

ServerOptions AuthOptions() {
  const std::string path = WriteTwoTenantTokenFile("tenant-tokens.txt");
  ServerOptions o = TinyOptions(512);
  o.auth_token_file = path;
  o.request_workers = 8;
  return o;
}

grpc::Status Prefill(v1::Attention::Stub* stub, const std::string& token, const std::string& id,
                     std::mt19937* rng) {
  auto ctx = Context(token);
  v1::PrefillResponse resp;
  return stub->Prefill(ctx.get(), MakePrefill(id, 0, 1, rng), &resp);
}

grpc::Status Release(v1::Attention::Stub* stub, const std::string& token, const std::string& id) {
  auto ctx = Context(token);
  v1::ReleaseSequenceRequest req;
  req.set_sequence_id(id);
  v1::ReleaseSequenceResponse resp;
  return stub->ReleaseSequence(ctx.get(), req, &resp);
}

// Several threads share ONE channel (one connection) and interleave both tenants' tokens call by
// call. Every sequence must belong to the tenant that created it: its owner's Prefill and Release
// succeed, the other tenant's get NOT_FOUND. Nothing leaks: the pool is whole at the end.
TEST(TenantIdentityTest, TwoTenantsInterleavedOnOneChannelNeverConfused) {
  Daemon daemon(AuthOptions());
  ASSERT_TRUE(daemon.ok());
  auto stub = v1::Attention::NewStub(daemon.Channel());
  std::atomic<int64_t> calls{0}, confused{0}, failed{0};
  absl::Mutex first_error_mu;
  std::string first_error;
  auto note = [&](const std::string& what) {
    absl::MutexLock lock(&first_error_mu);
    if (first_error.empty()) first_error = what;
  };
  const absl::Time end = absl::Now() + TestDuration();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; absl::Now() < end; ++i) {
        const bool a = (i + t) % 2 == 0;
        const std::string& owner = a ? kTokenA : kTokenB;
        const std::string& other = a ? kTokenB : kTokenA;
        std::string id;
        grpc::Status s = Create(stub.get(), owner, &id);
        ++calls;
        if (!s.ok()) {
          ++failed;
          note(absl::StrCat("CreateSequence: ", s.error_code(), " ", s.error_message()));
          continue;
        }
        s = Prefill(stub.get(), other, id, &rng);
        ++calls;
        if (s.error_code() != grpc::StatusCode::NOT_FOUND) {
          ++confused;
          note(absl::StrCat("the other tenant's Prefill got ", s.error_code(), " ",
                            s.error_message()));
        }
        s = Prefill(stub.get(), owner, id, &rng);
        ++calls;
        if (!s.ok()) {
          ++confused;
          note(absl::StrCat("the owner's Prefill got ", s.error_code(), " ", s.error_message()));
        }
        s = Release(stub.get(), other, id);
        ++calls;
        if (s.error_code() != grpc::StatusCode::NOT_FOUND) ++confused;
        s = Release(stub.get(), owner, id);
        ++calls;
        if (!s.ok()) {
          ++confused;
          note(absl::StrCat("the owner's Release got ", s.error_code(), " ", s.error_message()));
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  std::cout << "calls " << calls.load() << ", tenants confused " << confused.load()
            << ", failed creates " << failed.load() << "\n";
  EXPECT_GT(calls.load(), 100);
  EXPECT_EQ(confused.load(), 0) << first_error;
  EXPECT_EQ(failed.load(), 0) << first_error;

  auto ctx = Context(kTokenA);
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub->GetServerInfo(ctx.get(), v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.live_sequences(), 0);
}

// 100 CreateSequence calls in flight at once on one authenticated connection, again and again:
// the daemon answers every one OK (it used to die within seconds), and the cost per call does not
// grow with the number of calls the connection has carried.
TEST(TenantIdentityTest, ConcurrentCallsOnOneAuthenticatedConnectionAllSucceed) {
  Daemon daemon(AuthOptions());
  ASSERT_TRUE(daemon.ok());
  auto stub = v1::Attention::NewStub(daemon.Channel());
  const absl::Time end = absl::Now() + TestDuration();
  int64_t rounds = 0, ok = 0, bad = 0;
  std::string first_error;
  absl::Duration first_round, last_round;
  while (absl::Now() < end) {
    constexpr int kInFlight = 100;
    struct Call {
      grpc::ClientContext ctx;
      v1::CreateSequenceRequest req;
      v1::CreateSequenceResponse resp;
      grpc::Status status;
    };
    std::vector<std::unique_ptr<Call>> batch(kInFlight);
    absl::Mutex mu;
    int done = 0;
    const absl::Time t0 = absl::Now();
    for (int i = 0; i < kInFlight; ++i) {
      batch[i] = std::make_unique<Call>();
      batch[i]->ctx.AddMetadata("authorization", "Bearer " + kTokenA);
      batch[i]->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      Call* c = batch[i].get();
      stub->async()->CreateSequence(&c->ctx, &c->req, &c->resp, [&, c](grpc::Status s) {
        absl::MutexLock lock(&mu);
        c->status = std::move(s);
        ++done;
      });
    }
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(
          +[](int* d) { return *d == kInFlight; }, &done));
    }
    const absl::Duration round = absl::Now() - t0;
    if (rounds == 0) first_round = round;
    last_round = round;
    ++rounds;
    // Release them so the pool's sequence limit is never what stops the test.
    for (auto& c : batch) {
      if (c->status.ok()) {
        ++ok;
        EXPECT_TRUE(Release(stub.get(), kTokenA, c->resp.sequence_id()).ok());
      } else {
        ++bad;
        if (first_error.empty()) {
          first_error = absl::StrCat(c->status.error_code(), " ", c->status.error_message());
        }
      }
    }
  }
  std::cout << rounds << " rounds of 100 concurrent calls, " << ok << " OK, " << bad
            << " failed; first round " << absl::FormatDuration(first_round) << ", last "
            << absl::FormatDuration(last_round) << "\n";
  EXPECT_GT(rounds, 2);
  EXPECT_EQ(bad, 0) << first_error;
}

}  // namespace
}  // namespace ops_testing
}  // namespace attnd
