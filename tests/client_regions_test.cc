// The C++ client's side of the zero-copy data plane (client/regions.h) against an in-process daemon
// on the CPU backend: requests whose q/k/v are region references and whose output goes to a region
// give the same bytes as inline requests; RingClient carries prefills and decodes (inline or by
// reference) with the same results; a ring the server closes answers UNAVAILABLE; RAII objects
// unregister and close what they own; attnctl bench runs the shm and ring transports.
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/attnctl.h"
#include "client/cuda_buffer.h"
#include "client/regions.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

using client::DecodeInput;
using client::HostTensor;
using client::PrefillInput;
using client::RegisteredRegion;
using client::RingClient;
using client::ShmBuffer;
using client::TensorRef;
using ::testing::HasSubstr;

class ClientRegionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options = testing::SmallCpuOptions();
    options.ring_spin = absl::Microseconds(20);
    auto daemon = testing::TestDaemon::Start(geometry_, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
  }
  client::AttndClient& c() { return daemon_->client(); }

  HostTensor Random(std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return HostTensor::FromFloats(DType::kBf16, shape, testing::RandomInputs(&rng_, n));
  }
  std::string NewSeq() {
    absl::StatusOr<std::string> id = c().CreateSequence();
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }
  testing::ModelGeometry geometry_;
  std::unique_ptr<testing::TestDaemon> daemon_;
  std::mt19937 rng_{7};
};

TEST_F(ClientRegionsTest, ShmReferencesAndOutputRegionsMatchInlineBytes) {
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const int64_t t = 40;
  HostTensor q = Random({t, 5, hq, d}), k = Random({t, hkv, d}), v = Random({t, hkv, d});
  auto buf = ShmBuffer::Create(1 << 20);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto region = RegisteredRegion::Shm(c(), **buf);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(region->size(), 1u << 20);
  const uint64_t q_off = 0, k_off = 256 << 10, v_off = 320 << 10, o_off = 512 << 10;
  std::memcpy((*buf)->data() + q_off, q.data.data(), q.data.size());
  std::memcpy((*buf)->data() + k_off, k.data.data(), k.data.size());
  std::memcpy((*buf)->data() + v_off, v.data.data(), v.data.size());

  const std::string a = NewSeq(), b = NewSeq();
  auto want = c().Prefill(a, 0, q, k, v);
  ASSERT_TRUE(want.ok()) << want.status();
  PrefillInput in;
  in.sequence_id = b;
  in.q = region->Tensor(q_off, DType::kBf16, q.shape);
  in.k = region->Tensor(k_off, DType::kBf16, k.shape);
  in.v = region->Tensor(v_off, DType::kBf16, v.shape);
  in.output_region = region->Ref(o_off, want->o.data.size());
  auto got = c().Prefill(in);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->length, t);
  ASSERT_TRUE(got->o_region.has_value());
  EXPECT_EQ(got->o_region->offset(), o_off);
  EXPECT_TRUE(got->o.data.empty());
  EXPECT_EQ(got->o.shape, want->o.shape);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*buf)->data() + o_off), want->o.data.size()),
            want->o.data);

  // Decode: a mix of inline bytes and references, output to the region, through a Session too.
  HostTensor dq = Random({3, hq, d}), dk = Random({hkv, d}), dv = Random({hkv, d});
  std::memcpy((*buf)->data() + q_off, dq.data.data(), dq.data.size());
  DecodeInput plain{a, dq, dk, dv};
  auto want_d = c().Decode(0, {plain});
  ASSERT_TRUE(want_d.ok()) << want_d.status();
  DecodeInput ref{b, HostTensor(), dk, dv};
  ref.q_ref = region->Tensor(q_off, DType::kBf16, dq.shape);
  ref.output_region = region->Ref(o_off, want_d->at(0).o.data.size());
  auto session = c().OpenSession();
  ASSERT_TRUE(session.ok());
  auto got_d = (*session)->Decode(0, {ref});
  ASSERT_TRUE(got_d.ok()) << got_d.status();
  EXPECT_EQ(got_d->at(0).length, t + 1);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*buf)->data() + o_off),
                        want_d->at(0).o.data.size()),
            want_d->at(0).o.data);
  EXPECT_TRUE((*session)->Close().ok());

  // A reference past the end is INVALID_ARGUMENT; after Unregister the id is NOT_FOUND.
  in.q = region->Tensor((1 << 20) - 64, DType::kBf16, q.shape);
  EXPECT_EQ(c().Prefill(in).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string id = region->id();
  EXPECT_TRUE(region->Unregister().ok());
  in.q = TensorRef::In(id, q_off, DType::kBf16, q.shape);
  EXPECT_EQ(c().Prefill(in).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c().UnregisterRegion(id).code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientRegionsTest, RegisteredRegionUnregistersOnDestruction) {
  auto buf = ShmBuffer::Create(64 << 10);
  ASSERT_TRUE(buf.ok());
  std::string id;
  {
    auto region = RegisteredRegion::Shm(c(), **buf);
    ASSERT_TRUE(region.ok()) << region.status();
    id = region->id();
    EXPECT_THAT(id, ::testing::MatchesRegex("[0-9a-f]{32}"));
    RegisteredRegion moved = std::move(*region);
    EXPECT_EQ(moved.id(), id);
  }
  EXPECT_EQ(c().UnregisterRegion(id).code(), absl::StatusCode::kNotFound);
  // A part of the object, at a page offset.
  auto part = RegisteredRegion::Shm(c(), **buf, 4096, 8192);
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_EQ(part->size(), 8192u);
  EXPECT_EQ(RegisteredRegion::Shm(c(), **buf, 100, 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientRegionsTest, RingCarriesPrefillAndDecodeLikeUnaryCalls) {
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  client::RingOptions options;
  options.half_bytes = 1 << 20;
  auto ring = RingClient::Open(c(), options);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_THAT((*ring)->ring_id(), ::testing::MatchesRegex("[0-9a-f]{32}"));
  const std::string a = NewSeq(), b = NewSeq();
  HostTensor q = Random({33, 5, hq, d}), k = Random({33, hkv, d}), v = Random({33, hkv, d});
  auto want = c().Prefill(a, 1, q, k, v, 50);
  auto got = (*ring)->Prefill(b, 1, q, k, v, 50);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status();
  EXPECT_EQ(got->o.data, want->o.data);
  EXPECT_EQ(got->length, 33);
  for (int step = 0; step < 50; ++step) {
    DecodeInput da{a, Random({3, hq, d}), Random({hkv, d}), Random({hkv, d})};
    DecodeInput db = da;
    db.sequence_id = b;
    auto wd = c().Decode(1, {da});
    auto gd = (*ring)->Decode(1, {db});
    ASSERT_TRUE(wd.ok() && gd.ok()) << gd.status();
    ASSERT_EQ(gd->at(0).o.data, wd->at(0).o.data) << step;
    EXPECT_EQ(gd->at(0).length, 34 + step);
    if (step % 10 == 9) absl::SleepFor(absl::Milliseconds(5));  // let the server's thread sleep
  }
  // The request's own errors come back as its status; the ring goes on.
  DecodeInput bad{"0123456789abcdef0123456789abcdef", Random({3, hq, d}), Random({hkv, d}),
                  Random({hkv, d})};
  EXPECT_EQ((*ring)->Decode(1, {bad}).status().code(), absl::StatusCode::kNotFound);
  bad.sequence_id = b;
  bad.k = Random({hkv + 1, d});
  EXPECT_EQ((*ring)->Decode(1, {bad}).status().code(), absl::StatusCode::kInvalidArgument);
  const client::RingStats& stats = (*ring)->stats();
  EXPECT_EQ(stats.round_trips, 53);
  EXPECT_EQ(stats.answered_spinning + stats.answered_sleeping, 53);
  EXPECT_GT(stats.server_wakes, 0);  // after the pauses the server had gone to sleep

  // With references: q/k/v and o in a registered region, through the ring.
  auto buf = ShmBuffer::Create(1 << 20);
  ASSERT_TRUE(buf.ok());
  auto region = RegisteredRegion::Shm(c(), **buf);
  ASSERT_TRUE(region.ok()) << region.status();
  DecodeInput da{a, Random({3, hq, d}), Random({hkv, d}), Random({hkv, d})};
  std::memcpy((*buf)->data(), da.q.data.data(), da.q.data.size());
  std::memcpy((*buf)->data() + 4096, da.k.data.data(), da.k.data.size());
  std::memcpy((*buf)->data() + 8192, da.v.data.data(), da.v.data.size());
  DecodeInput db;
  db.sequence_id = b;
  db.q_ref = region->Tensor(0, DType::kBf16, da.q.shape);
  db.k_ref = region->Tensor(4096, DType::kBf16, da.k.shape);
  db.v_ref = region->Tensor(8192, DType::kBf16, da.v.shape);
  db.output_region = region->Ref(65536, hq * d * 2);
  auto wd = c().Decode(1, {da});
  auto gd = (*ring)->Decode(1, {db});
  ASSERT_TRUE(wd.ok() && gd.ok()) << gd.status();
  ASSERT_TRUE(gd->at(0).o_region.has_value());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*buf)->data() + 65536), hq * d * 2),
            wd->at(0).o.data);

  // CloseRing: the server sets `closed`; the ring then answers UNAVAILABLE without waiting.
  EXPECT_TRUE((*ring)->Close().ok());
  const absl::Time t0 = absl::Now();
  while ((*ring)->header()->closed.load() == 0 && absl::Now() - t0 < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ((*ring)->header()->closed.load(), 1u);
  EXPECT_EQ((*ring)->Decode(1, {da}).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ClientRegionsTest, RingTooSmallForTheRequestAndServerStop) {
  client::RingOptions options;
  options.half_bytes = 4096;
  // Its own connection, so the ring's destructor (CloseRing) can outlive the daemon's client.
  auto own = daemon_->NewClient();
  ASSERT_TRUE(own.ok()) << own.status();
  auto ring = RingClient::Open(**own, options);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  HostTensor q = Random({8, 5, hq, d}), k = Random({8, hkv, d});
  EXPECT_EQ((*ring)->Prefill(NewSeq(), 0, q, k, k).status().code(),
            absl::StatusCode::kResourceExhausted);
  // A server that stops closes its rings: a waiting client gives up with UNAVAILABLE.
  std::unique_ptr<RingClient> r = std::move(*ring);
  daemon_.reset();
  const absl::Time t0 = absl::Now();
  DecodeInput in{"0123456789abcdef0123456789abcdef", Random({3, hq, d}), Random({hkv, d}),
                 Random({hkv, d})};
  EXPECT_EQ(r->Decode(0, {in}).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  r.reset();  // CloseRing fails (no server); the destructor drops the error
}

TEST_F(ClientRegionsTest, BenchRunsTheShmAndRingTransports) {
  for (bool ring_regions : {false, true}) {
    std::ostringstream out, err;
    client::BenchOptions options;
    options.contexts = {70};
    options.prefill_chunk = 32;
    options.decode_steps = 4;
    options.batch = 2;
    options.progress = false;
    options.transports = {"shm", "ring", "cuda-ipc", "ring-cuda-ipc"};
    options.ring_regions = ring_regions;
    EXPECT_EQ(client::RunBench(c(), options, out, err), 0) << out.str() << err.str();
    const std::string s = out.str();
    EXPECT_THAT(s, HasSubstr("transport: shm (unary RPCs, q/k/v and o in a registered"));
    EXPECT_THAT(s, HasSubstr("outputs verified once against gRPC's bytes"));
    EXPECT_THAT(s, HasSubstr(ring_regions ? "q/k/v and o in a registered"
                                          : "client spin 50 us), tensor bytes inline"));
    // This attnctl cannot (built without CUDA), or the CPU server cannot: a skip either way.
    EXPECT_THAT(s, HasSubstr(client::ClientBuiltWithCuda()
                                 ? "transport: cuda-ipc: skipped: the server (backend cpu) accepts "
                                   "no CUDA IPC regions"
                                 : "transport: cuda-ipc: skipped: attnctl was built without CUDA"));
    EXPECT_THAT(s, HasSubstr(client::ClientBuiltWithCuda()
                                 ? "transport: ring-cuda-ipc: skipped: the server (backend cpu) "
                                   "accepts no CUDA IPC regions"
                                 : "transport: ring-cuda-ipc: skipped: attnctl was built without "
                                   "CUDA: ring-cuda-ipc needs a CUDA build of attnctl"));
    EXPECT_THAT(s, ::testing::ContainsRegex("\n +70( +[0-9.]+){7}\n(#[^\n]*\n)*\ntransport: ring"));
    // Each transport's table ends with where the KV was before the release: one shard here.
    EXPECT_THAT(s, HasSubstr("# context 70, before release: shard 0 cpu: "));
    absl::StatusOr<v1::GetServerInfoResponse> info = c().Info();
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->live_sequences(), 0);
    EXPECT_EQ(info->kv_cache().pages_free(), info->kv_cache().pages_total());
  }
}

// With authentication each tenant names its objects under its own prefix, which the server gives
// in GetServerInfo: ShmBuffer::CreateFor and RingClient::Open use it, and attnd refuses to map
// another tenant's object (or one outside "/attnd-"), so no tenant can make it read or write
// memory that is not its own.
TEST(ClientRegionsAuthTest, EachTenantRegistersOnlyObjectsNamedForIt) {
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/regions-tokens.", getpid());
  std::ofstream(tokens) << "alice token-of-alice-0123456789abcdef\n"
                        << "bob token-of-bob-fedcba9876543210abc\n";
  ServerOptions options = testing::SmallCpuOptions();
  options.auth_token_file = tokens;
  testing::ModelGeometry geometry;
  auto daemon = testing::TestDaemon::Start(geometry, options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto connect = [&](const std::string& token) {
    client::ClientOptions o;
    o.token = token;
    auto c = client::AttndClient::Connect((*daemon)->target(), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  };
  std::unique_ptr<client::AttndClient> alice = connect("token-of-alice-0123456789abcdef");
  std::unique_ptr<client::AttndClient> bob = connect("token-of-bob-fedcba9876543210abc");
  ASSERT_TRUE(alice != nullptr && bob != nullptr);
  absl::StatusOr<v1::GetServerInfoResponse> info = alice->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->regions().shm_name_prefix(), "/attnd-alice.");

  auto alices = ShmBuffer::CreateFor(*alice, 1 << 16);
  ASSERT_TRUE(alices.ok()) << alices.status();
  EXPECT_THAT((*alices)->name(), ::testing::MatchesRegex("/attnd-alice\\.[0-9a-f]{32}"));
  auto region = RegisteredRegion::Shm(*alice, **alices);
  EXPECT_TRUE(region.ok()) << region.status();
  // Bob knows the name (anyone on the host can list /dev/shm) but cannot map it.
  absl::StatusOr<RegisteredRegion> stolen = RegisteredRegion::Shm(*bob, **alices);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stolen.status().message(), HasSubstr("\"/attnd-bob.\""));
  absl::StatusOr<v1::OpenRingResponse> ring_of_alices =
      bob->OpenRing((*alices)->name(), (*alices)->size());
  EXPECT_EQ(ring_of_alices.status().code(), absl::StatusCode::kInvalidArgument);
  // A name outside the tenant's prefix, as an unauthenticated client would make it.
  auto plain = ShmBuffer::Create(1 << 16);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(RegisteredRegion::Shm(*alice, **plain).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Rings: named for the caller by RingClient::Open, and they carry requests.
  auto ring = RingClient::Open(*bob);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_THAT((*ring)->buffer().name(), ::testing::MatchesRegex("/attnd-bob\\.[0-9a-f]{32}"));
  absl::StatusOr<std::string> seq = bob->CreateSequence();
  ASSERT_TRUE(seq.ok()) << seq.status();
  std::mt19937 rng(3);
  const int64_t t = 4, hq = geometry.num_q_heads, hkv = geometry.num_kv_heads,
                d = geometry.head_dim;
  auto random = [&](std::vector<int64_t> shape, int64_t n) {
    return HostTensor::FromFloats(DType::kFp32, shape, testing::RandomInputs(&rng, n));
  };
  auto done = (*ring)->Prefill(*seq, 0, random({t, 5, hq, d}, t * 5 * hq * d),
                               random({t, hkv, d}, t * hkv * d), random({t, hkv, d}, t * hkv * d));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->length, t);
}

}  // namespace
}  // namespace attnd
