// A fleet on loopback (docs/fleet.md): three attnd processes with distinct --instance-name and the
// tiny model on the CPU, driven through client::FleetClient. Least-loaded placement spreads the
// sequences, outputs equal a single daemon's, a call sent to the wrong daemon is
// FAILED_PRECONDITION naming the owner; one daemon SIGKILLed mid-run: its sequences fail
// UNAVAILABLE naming it, the others keep working, new sequences go to live daemons only; restarted
// under the same name it holds nothing (NOT_FOUND) and its sequences are re-created and
// re-prefilled.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/attnd_client.h"
#include "client/fleet_client.h"
#include "client/host_tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

extern char** environ;

namespace attnd {
namespace {

using client::AttndClient;
using client::DecodeInput;
using client::FleetClient;
using client::HostTensor;

constexpr int kHq = 4, kHkv = 2, kD = 64;  // configs/tiny
constexpr int64_t kPages = 64;
constexpr int64_t kPageBytes = 32768;  // fp32 KV: 2 layers x K,V x 16 tokens x 2 heads x 64 x 4 B

int FreePort() {
  // Bound and released: another process could take it meanwhile (unlikely on loopback in a test).
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// attnd in a process of its own, so that it can be SIGKILLed like a crashed pod.
class ChildDaemon {
 public:
  explicit ChildDaemon(std::string instance, std::vector<std::string> extra_args = {})
      : instance_(std::move(instance)), extra_args_(std::move(extra_args)) {
    target_ = absl::StrCat("127.0.0.1:", FreePort());
  }
  ~ChildDaemon() { Kill(); }

  // Starts it and waits until it answers. The first start may move to another free port when
  // something else took this one meanwhile (tests run in parallel); a restart after Kill keeps it.
  absl::Status Start() {
    absl::Status s;
    for (int attempt = 0; attempt < 5; ++attempt) {
      s = StartOnce();
      if (s.ok() || started_ || s.code() != absl::StatusCode::kAborted) break;
      target_ = absl::StrCat("127.0.0.1:", FreePort());
    }
    if (s.ok()) started_ = true;
    return s;
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  // SIGSTOP returns once every thread is stopped (kill() returns before that).
  void Signal(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    if (sig != SIGSTOP) return;
    for (int i = 0; i < 1000; ++i) {
      std::ifstream stat(absl::StrCat("/proc/", pid_, "/stat"));
      std::string pid, comm, state;
      stat >> pid >> comm >> state;
      if (state == "T") return;
      absl::SleepFor(absl::Milliseconds(2));
    }
  }
  const std::string& target() const { return target_; }
  const std::string& instance() const { return instance_; }

 private:
  // ABORTED when the port was taken: attnd exited, or another process answered there.
  absl::Status StartOnce() {
    std::string binary = "server/attnd";
    if (const char* srcdir = std::getenv("TEST_SRCDIR")) {
      binary = absl::StrCat(srcdir, "/attnd/server/attnd");
    }
    std::vector<std::string> args = {binary,
                                     "--device=cpu",
                                     "--listen=" + target_,
                                     "--metrics-listen=",
                                     "--model-config=configs/tiny/config.json",
                                     absl::StrCat("--kv-cache-bytes=", kPages * kPageBytes),
                                     "--page-size=16",
                                     "--compute-threads=1",
                                     "--request-workers=2",
                                     "--log-level=warn"};
    if (!instance_.empty()) {
      args.push_back("--instance-name=" + instance_);
      args.push_back("--advertise-address=" + target_);
    }
    args.insert(args.end(), extra_args_.begin(), extra_args_.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int err = posix_spawn(&pid_, binary.c_str(), nullptr, nullptr, argv.data(), environ);
    if (err != 0) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("cannot start ", binary, ": ", std::strerror(err)));
    }
    client::ClientOptions options;
    options.connect_timeout = absl::Seconds(1);
    // Its own subchannel: readiness checked here must not warm up the one the fleet client's
    // channels would share (the test must see the fleet client reconnect by itself).
    options.channel_args.emplace_back("grpc.use_local_subchannel_pool", 1);
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::Status last;
    while (absl::Now() < deadline) {
      if (Exited()) return absl::AbortedError(absl::StrCat("attnd ", instance_, " exited"));
      absl::StatusOr<std::unique_ptr<AttndClient>> c = AttndClient::Connect(target_, options);
      if (c.ok()) {
        // Ours? A daemon that cannot bind exits within milliseconds; a named one says its name.
        absl::SleepFor(absl::Milliseconds(150));
        absl::StatusOr<v1::GetServerInfoResponse> info = (*c)->Info();
        // With tokens on, an unauthenticated GetServerInfo is UNAUTHENTICATED: still an answer.
        if (!info.ok() && info.status().code() == absl::StatusCode::kUnauthenticated) {
          return Exited() ? absl::AbortedError(absl::StrCat(target_, " is another process's"))
                          : absl::OkStatus();
        }
        if (Exited() || !info.ok() || info->instance().name() != instance_) {
          Kill();
          return absl::AbortedError(absl::StrCat(target_, " is another process's"));
        }
        return absl::OkStatus();
      }
      last = c.status();
      absl::SleepFor(absl::Milliseconds(50));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("attnd ", instance_, " never answered: ", last.ToString()));
  }
  bool Exited() {
    int status = 0;
    if (pid_ > 0 && waitpid(pid_, &status, WNOHANG) == pid_) pid_ = -1;
    return pid_ <= 0;
  }

  std::string instance_;
  std::vector<std::string> extra_args_;
  std::string target_;
  pid_t pid_ = -1;
  bool started_ = false;
};

struct Inputs {
  HostTensor q, k, v;
};

Inputs PrefillInputs(std::mt19937* rng, int64_t t) {
  return {HostTensor::FromFloats(DType::kFp32, {t, 5, kHq, kD},
                                 testing::RandomInputs(rng, t * 5 * kHq * kD)),
          HostTensor::FromFloats(DType::kFp32, {t, kHkv, kD},
                                 testing::RandomInputs(rng, t * kHkv * kD)),
          HostTensor::FromFloats(DType::kFp32, {t, kHkv, kD},
                                 testing::RandomInputs(rng, t * kHkv * kD))};
}

DecodeInput DecodeEntry(const std::string& id, std::mt19937* rng) {
  DecodeInput e;
  e.sequence_id = id;
  e.q =
      HostTensor::FromFloats(DType::kFp32, {3, kHq, kD}, testing::RandomInputs(rng, 3 * kHq * kD));
  e.k = HostTensor::FromFloats(DType::kFp32, {kHkv, kD}, testing::RandomInputs(rng, kHkv * kD));
  e.v = HostTensor::FromFloats(DType::kFp32, {kHkv, kD}, testing::RandomInputs(rng, kHkv * kD));
  return e;
}

std::string Owner(const std::string& id) {
  absl::StatusOr<std::string> owner = FleetClient::OwnerOf(id);
  EXPECT_TRUE(owner.ok()) << owner.status();
  return owner.ok() ? *owner : "";
}

std::string OwnedBy(const std::string& id, const std::string& owner, const std::string& self) {
  return absl::StrCat("sequence ", id, " is owned by attnd instance \"", owner, "\" (this is \"",
                      self, "\"); send calls for it to that instance");
}

class FleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"fleet-a", "fleet-b", "fleet-c"}) {
      daemons_.push_back(std::make_unique<ChildDaemon>(name));
    }
    for (auto& d : daemons_) ASSERT_TRUE(d->Start().ok()) << d->instance();
    std::vector<std::string> targets;
    for (auto& d : daemons_) targets.push_back(d->target());
    absl::StatusOr<std::unique_ptr<FleetClient>> fleet = FleetClient::Connect(targets);
    ASSERT_TRUE(fleet.ok()) << fleet.status();
    fleet_ = *std::move(fleet);
  }

  absl::StatusOr<std::unique_ptr<AttndClient>> Direct(int i) {
    return AttndClient::Connect(daemons_[i]->target());
  }

  std::mt19937 rng_{21};
  std::vector<std::unique_ptr<ChildDaemon>> daemons_;
  std::unique_ptr<FleetClient> fleet_;
};

TEST_F(FleetTest, PlacesLeastLoadedRoutesByIdAndMatchesOneDaemon) {
  // Who is who, learned from GetServerInfo.
  std::vector<client::FleetEndpoint> endpoints = fleet_->Endpoints();
  ASSERT_EQ(endpoints.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(endpoints[i].target, daemons_[i]->target());
    EXPECT_EQ(endpoints[i].instance, daemons_[i]->instance());
    EXPECT_TRUE(endpoints[i].connected);
  }

  // Least loaded: each prefill takes ceil(T / 16) pages of its daemon's 64, so the next sequence
  // goes where the most are left; equal daemons are taken in turn.
  const std::vector<int64_t> tokens = {48, 32, 16, 48, 20};
  const std::vector<std::string> want_owner = {"fleet-a", "fleet-b", "fleet-c", "fleet-c",
                                               "fleet-b"};
  // free pages after each prefill: a 61 b 64 c 64 -> b; a 61 b 62 c 64 -> c; a 61 b 62 c 63 -> c;
  // a 61 b 62 c 60 -> b.
  ChildDaemon single("");  // the same work on one unnamed daemon, for the outputs
  ASSERT_TRUE(single.Start().ok());
  absl::StatusOr<std::unique_ptr<AttndClient>> one = AttndClient::Connect(single.target());
  ASSERT_TRUE(one.ok()) << one.status();

  std::vector<std::string> ids, refs;
  for (size_t s = 0; s < tokens.size(); ++s) {
    absl::StatusOr<std::string> id = fleet_->CreateSequence();
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(Owner(*id), want_owner[s]) << "sequence " << s;
    absl::StatusOr<std::string> ref = (*one)->CreateSequence();
    ASSERT_TRUE(ref.ok()) << ref.status();
    EXPECT_FALSE(absl::StrContains(*ref, ".")) << *ref;  // unnamed: bare 32 hex
    for (int32_t layer = 0; layer < 2; ++layer) {
      const Inputs in = PrefillInputs(&rng_, tokens[s]);
      absl::StatusOr<client::PrefillResult> got = fleet_->Prefill(*id, layer, in.q, in.k, in.v);
      ASSERT_TRUE(got.ok()) << got.status();
      absl::StatusOr<client::PrefillResult> want = (*one)->Prefill(*ref, layer, in.q, in.k, in.v);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(got->length, tokens[s]);
      EXPECT_EQ(got->o.shape, want->o.shape);
      EXPECT_EQ(got->o.data, want->o.data) << "sequence " << s << " layer " << layer;
    }
    ids.push_back(*id);
    refs.push_back(*ref);
  }
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::unique_ptr<AttndClient>> c = Direct(i);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<v1::GetServerInfoResponse> info = (*c)->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->instance().name(), daemons_[i]->instance());
    EXPECT_EQ(info->instance().advertise_address(), daemons_[i]->target());
  }

  // One Decode over sequences of all three daemons: one call per daemon, outputs in entry order,
  // equal to one daemon's batch.
  for (int step = 0; step < 2; ++step) {
    std::vector<DecodeInput> entries, ref_entries;
    for (size_t s = 0; s < ids.size(); ++s) {
      entries.push_back(DecodeEntry(ids[s], &rng_));
      ref_entries.push_back(entries.back());
      ref_entries.back().sequence_id = refs[s];
    }
    absl::StatusOr<std::vector<client::DecodeResult>> got = fleet_->Decode(1, entries);
    ASSERT_TRUE(got.ok()) << got.status();
    absl::StatusOr<std::vector<client::DecodeResult>> want = (*one)->Decode(1, ref_entries);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(got->size(), ids.size());
    for (size_t s = 0; s < ids.size(); ++s) {
      EXPECT_EQ((*got)[s].length, tokens[s] + step + 1);
      EXPECT_EQ((*got)[s].o.data, (*want)[s].o.data) << "decode step " << step << " entry " << s;
    }
  }

  // Straight to the wrong daemon: FAILED_PRECONDITION naming the owner, for each kind of call.
  absl::StatusOr<std::unique_ptr<AttndClient>> b = Direct(1);
  ASSERT_TRUE(b.ok()) << b.status();
  const Inputs in = PrefillInputs(&rng_, 2);
  absl::StatusOr<client::PrefillResult> wrong = (*b)->Prefill(ids[0], 0, in.q, in.k, in.v);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(wrong.status().message(), OwnedBy(ids[0], "fleet-a", "fleet-b"));
  // A batch: its own sequence first, then fleet-c's, then fleet-a's: the first foreign one decides.
  absl::StatusOr<std::vector<client::DecodeResult>> batch = (*b)->Decode(
      0, {DecodeEntry(ids[1], &rng_), DecodeEntry(ids[2], &rng_), DecodeEntry(ids[0], &rng_)});
  EXPECT_EQ(batch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(batch.status().message(),
            absl::StrCat("entries[1]: ", OwnedBy(ids[2], "fleet-c", "fleet-b")));
  absl::StatusOr<int64_t> released = (*b)->Release(ids[0]);
  EXPECT_EQ(released.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(released.status().message(), OwnedBy(ids[0], "fleet-a", "fleet-b"));
  // The unnamed daemon has no instance name to own it by.
  absl::StatusOr<int64_t> unnamed = (*one)->Release(ids[0]);
  EXPECT_EQ(unnamed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(unnamed.status().message(),
            absl::StrCat("sequence ", ids[0],
                         " is owned by attnd instance \"fleet-a\" (this daemon has no instance "
                         "name); send calls for it to that instance"));

  // Release through the fleet: the owner frees its pages (48 tokens and 2 decoded: 4 pages).
  absl::StatusOr<int64_t> freed = fleet_->Release(ids[0]);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 4);
  absl::StatusOr<client::PrefillResult> gone = fleet_->Prefill(ids[0], 0, in.q, in.k, in.v);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(), absl::StrCat("sequence ", ids[0], " not found"));
  // Now fleet-a holds nothing: 64 free, the most.
  absl::StatusOr<std::string> next = fleet_->CreateSequence();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(Owner(*next), "fleet-a");
}

TEST_F(FleetTest, ADaemonKilledMidRunLosesOnlyItsSequences) {
  // Empty sequences hold no pages: every daemon stays equal, so they are taken in turn.
  std::vector<std::string> ids;
  std::map<std::string, std::vector<std::string>> by_owner;
  for (int s = 0; s < 6; ++s) {
    absl::StatusOr<std::string> id = fleet_->CreateSequence();
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    by_owner[Owner(*id)].push_back(*id);
  }
  for (const char* name : {"fleet-a", "fleet-b", "fleet-c"}) {
    EXPECT_EQ(by_owner[name].size(), 2u) << name;
  }
  for (const std::string& id : ids) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      const Inputs in = PrefillInputs(&rng_, 20);
      ASSERT_TRUE(fleet_->Prefill(id, layer, in.q, in.k, in.v).ok()) << id;
    }
  }

  // Decodes keep running on fleet-a and fleet-c while fleet-b is killed.
  std::atomic<bool> stop{false}, survivor_failed{false};
  std::atomic<int> survivor_steps{0};
  std::string survivor_error;  // written by the runner before survivor_failed, read after join
  std::thread runner([&] {
    std::mt19937 rng(7);
    while (!stop.load()) {
      absl::StatusOr<std::vector<client::DecodeResult>> r = fleet_->Decode(
          0,
          {DecodeEntry(by_owner["fleet-a"][0], &rng), DecodeEntry(by_owner["fleet-c"][0], &rng)});
      if (!r.ok()) {
        survivor_error = r.status().ToString();
        survivor_failed = true;
        return;
      }
      ++survivor_steps;
    }
  });
  while (survivor_steps.load() < 3 && !survivor_failed.load()) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  daemons_[1]->Kill();
  const int steps_at_kill = survivor_steps.load();

  for (const std::string& id : by_owner["fleet-b"]) {
    absl::StatusOr<std::vector<client::DecodeResult>> r =
        fleet_->Decode(1, {DecodeEntry(id, &rng_)});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    EXPECT_TRUE(absl::StartsWith(
        r.status().message(),
        absl::StrCat("attnd instance \"fleet-b\" at ", daemons_[1]->target(), " is unavailable: ")))
        << r.status();
    const Inputs in = PrefillInputs(&rng_, 1);
    absl::StatusOr<client::PrefillResult> p = fleet_->Prefill(id, 1, in.q, in.k, in.v);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable) << p.status();
    EXPECT_TRUE(absl::StrContains(p.status().message(), "attnd instance \"fleet-b\""))
        << p.status();
  }
  while (survivor_steps.load() < steps_at_kill + 3 && !survivor_failed.load()) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  stop = true;
  runner.join();
  EXPECT_FALSE(survivor_failed.load()) << survivor_error;
  EXPECT_GE(survivor_steps.load(), steps_at_kill + 3);

  // New sequences go only to the live daemons (equally loaded: in turn).
  std::set<std::string> placed;
  for (int s = 0; s < 4; ++s) {
    absl::StatusOr<std::string> id = fleet_->CreateSequence();
    ASSERT_TRUE(id.ok()) << id.status();
    placed.insert(Owner(*id));
  }
  EXPECT_EQ(placed, (std::set<std::string>{"fleet-a", "fleet-c"}));
  // The other sequences are whole: each of a's and c's second sequences decodes at length 21.
  for (const char* name : {"fleet-a", "fleet-c"}) {
    absl::StatusOr<std::vector<client::DecodeResult>> r =
        fleet_->Decode(1, {DecodeEntry(by_owner[name][1], &rng_)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].length, 21) << name;
  }

  // fleet-b comes back under its name, on its port, empty: its old sequences are NOT_FOUND, and are
  // re-created (it has the most free pages now, so it takes them) and re-prefilled.
  ASSERT_TRUE(daemons_[1]->Start().ok());
  for (const std::string& id : by_owner["fleet-b"]) {
    absl::StatusOr<std::vector<client::DecodeResult>> r =
        fleet_->Decode(1, {DecodeEntry(id, &rng_)});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
    EXPECT_EQ(r.status().message(), absl::StrCat("entries[0]: sequence ", id, " not found"));

    absl::StatusOr<std::string> again = fleet_->CreateSequence();
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(Owner(*again), "fleet-b");
    for (int32_t layer = 0; layer < 2; ++layer) {
      const Inputs in = PrefillInputs(&rng_, 20);
      absl::StatusOr<client::PrefillResult> p = fleet_->Prefill(*again, layer, in.q, in.k, in.v);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->length, 20);
    }
    absl::StatusOr<std::vector<client::DecodeResult>> d =
        fleet_->Decode(1, {DecodeEntry(*again, &rng_)});
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ((*d)[0].length, 21);
  }
}

// With tokens on a daemon hides pages_free from tenants (tenant_scoped): placement is round robin.
TEST(FleetClientTest, WithTokensPlacementIsRoundRobin) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string tokens =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/fleet-tokens-", getpid());
  {
    std::ofstream f(tokens);
    f << "team-a fleet-token-0123456789abcdef\n";
  }
  ChildDaemon d0("fleet-t0", {"--auth-token-file=" + tokens});
  ChildDaemon d1("fleet-t1", {"--auth-token-file=" + tokens});
  ASSERT_TRUE(d0.Start().ok());
  ASSERT_TRUE(d1.Start().ok());
  client::FleetOptions options;
  options.client.token = "fleet-token-0123456789abcdef";
  absl::StatusOr<std::unique_ptr<FleetClient>> fleet =
      FleetClient::Connect({d0.target(), d1.target()}, options);
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  std::mt19937 rng(3);
  std::vector<std::string> owners;
  for (int s = 0; s < 4; ++s) {
    absl::StatusOr<std::string> id = (*fleet)->CreateSequence();
    ASSERT_TRUE(id.ok()) << id.status();
    owners.push_back(Owner(*id));
    if (owners.back() == "fleet-t0") {  // load fleet-t0 only: least loaded would avoid it
      const Inputs in = PrefillInputs(&rng, 100);
      ASSERT_TRUE((*fleet)->Prefill(*id, 0, in.q, in.k, in.v).ok());
    }
  }
  EXPECT_EQ(owners, (std::vector<std::string>{"fleet-t0", "fleet-t1", "fleet-t0", "fleet-t1"}));
  std::remove(tokens.c_str());
}

TEST(FleetClientTest, ConnectFailsOnlyWhenNoDaemonAnswers) {
  const std::string dead1 = absl::StrCat("127.0.0.1:", FreePort());
  const std::string dead2 = absl::StrCat("127.0.0.1:", FreePort());
  absl::StatusOr<std::unique_ptr<FleetClient>> none = FleetClient::Connect({dead1, dead2});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StartsWith(none.status().message(),
                               absl::StrCat("no attnd of the fleet is reachable (", dead1, ": ")))
      << none.status();
  EXPECT_TRUE(absl::StrContains(none.status().message(), absl::StrCat("; ", dead2, ": ")))
      << none.status();

  ChildDaemon a("fleet-a");
  ASSERT_TRUE(a.Start().ok());
  absl::StatusOr<std::unique_ptr<FleetClient>> some = FleetClient::Connect({dead1, a.target()});
  ASSERT_TRUE(some.ok()) << some.status();
  for (int s = 0; s < 3; ++s) {
    absl::StatusOr<std::string> id = (*some)->CreateSequence();
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(Owner(*id), "fleet-a");
  }
  // A hung daemon (SIGSTOP: it accepts connections and never answers) is skipped after the probe
  // timeout instead of stalling placement.
  ChildDaemon hung("fleet-h");
  ASSERT_TRUE(hung.Start().ok());
  client::FleetOptions quick;
  quick.probe_timeout = absl::Seconds(1);  // room for a loaded machine (and ASan) on the live one
  absl::StatusOr<std::unique_ptr<FleetClient>> with_hung =
      FleetClient::Connect({hung.target(), a.target()}, quick);
  ASSERT_TRUE(with_hung.ok()) << with_hung.status();
  hung.Signal(SIGSTOP);
  const absl::Time t0 = absl::Now();
  for (int s = 0; s < 2; ++s) {
    absl::StatusOr<std::string> id = (*with_hung)->CreateSequence();
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(Owner(*id), "fleet-a");
  }
  EXPECT_LT(absl::Now() - t0, absl::Seconds(8));  // not the 10 s connect timeout, nor forever
  EXPECT_THAT((*with_hung)->Endpoints()[0].last_error, ::testing::HasSubstr("Deadline Exceeded"));
  hung.Signal(SIGCONT);

  // Through a DNS name (localhost: 127.0.0.1, and ::1 where it resolves, which nothing listens on).
  absl::StatusOr<std::unique_ptr<FleetClient>> by_name = FleetClient::Connect(
      {absl::StrCat("dns:///localhost:", a.target().substr(a.target().rfind(':') + 1))});
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  absl::StatusOr<std::string> named_id = (*by_name)->CreateSequence();
  ASSERT_TRUE(named_id.ok()) << named_id.status();
  EXPECT_EQ(Owner(*named_id), "fleet-a");
  EXPECT_TRUE((*by_name)->Release(*named_id).ok());

  // A daemon without --instance-name cannot be in a fleet: its ids would not say where they live.
  ChildDaemon unnamed("");
  ASSERT_TRUE(unnamed.Start().ok());
  absl::StatusOr<std::unique_ptr<FleetClient>> mixed =
      FleetClient::Connect({a.target(), unnamed.target()});
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(mixed.status().message(),
            absl::StrCat("attnd at ", unnamed.target(),
                         " has no --instance-name: in a fleet every daemon needs one, so that a "
                         "sequence id says which daemon holds it"));
  // An instance that comes back at another of the fleet's addresses (a rescheduled pod) is found
  // there after a Refresh; its sequences are gone.
  ChildDaemon x1("fleet-x"), x2("fleet-x");
  ASSERT_TRUE(x1.Start().ok());
  absl::StatusOr<std::unique_ptr<FleetClient>> moving =
      FleetClient::Connect({x1.target(), x2.target()});
  ASSERT_TRUE(moving.ok()) << moving.status();
  absl::StatusOr<std::string> lost = (*moving)->CreateSequence();
  ASSERT_TRUE(lost.ok()) << lost.status();
  x1.Kill();
  ASSERT_TRUE(x2.Start().ok());
  EXPECT_EQ((*moving)->Release(*lost).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE((*moving)->Refresh().ok());
  std::vector<client::FleetEndpoint> now = (*moving)->Endpoints();
  ASSERT_EQ(now.size(), 2u);
  EXPECT_EQ(now[0].instance, "");  // no longer who it was
  EXPECT_EQ(now[1].instance, "fleet-x");
  absl::StatusOr<int64_t> moved = (*moving)->Release(*lost);
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kNotFound) << moved.status();
  absl::StatusOr<std::string> placed = (*moving)->CreateSequence();
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(Owner(*placed), "fleet-x");

  absl::StatusOr<std::unique_ptr<FleetClient>> only_unnamed =
      FleetClient::Connect({unnamed.target()});
  EXPECT_EQ(only_unnamed.status().code(), absl::StatusCode::kFailedPrecondition);
  // A DNS name stands for every address it resolves to.
  absl::StatusOr<std::vector<std::string>> resolved =
      FleetClient::Resolve({"dns:///localhost:50051", "127.0.0.1:7"});
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_NE(std::find(resolved->begin(), resolved->end(), "127.0.0.1:50051"), resolved->end());
  EXPECT_EQ(resolved->back(), "127.0.0.1:7");
  EXPECT_EQ(FleetClient::Resolve({"dns:///localhost"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FleetClient::Resolve({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FleetClient::OwnerOf("0123456789abcdef0123456789abcdef").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnd
