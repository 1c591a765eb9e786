// Tensor regions and rings end to end (docs/regions.md), on the CPU backend over loopback: a
// sequence fed through a shm region (inputs and output) gives bit-identical outputs to a twin fed
// inline bytes; every bad reference is refused with its code and changes nothing; a ring carries
// Session requests (and a garbage one) through shared memory with the futex doorbell, written here
// by hand from proto/attnd/v1/shm_ring.h, independent of the client library; length fields past a
// ring's half are refused, and a ring whose object shrinks or that nobody uses is closed.
#include "server/dataplane/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "attnd/v1/ring_frame.h"
#include "attnd/v1/shm_ring.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/dataplane/ring.h"
#include "server/engine/fault_engine.h"
#include "server/rpc/server.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

constexpr size_t kShmBytes = 1 << 20;

// A client-side shm object, mapped; unlinked and unmapped at the end.
class Shm {
 public:
  // `prefix`: the tenant's (ShmNamePrefix): "/attnd-" with tokens off.
  explicit Shm(size_t bytes, const std::string& prefix = "/attnd-") : bytes_(bytes) {
    static std::atomic<int> counter{0};
    name_ = absl::StrCat(prefix, "regions-e2e-", getpid(), "-", counter++);
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
    base_ = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
  }
  ~Shm() {
    munmap(base_, bytes_);
    close(fd_);
    shm_unlink(name_.c_str());
  }
  char* base() { return base_; }
  const std::string& name() const { return name_; }
  void Truncate(size_t bytes) { ASSERT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }

 private:
  size_t bytes_;
  std::string name_;
  int fd_ = -1;
  char* base_ = nullptr;
};

class RegionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options = testing::SmallCpuOptions();
    options.region_idle_timeout = absl::Seconds(2);
    options.ring_spin = absl::Microseconds(20);
    Start(options);
  }

  // (Re)starts the daemon with `options`, and a stub on it.
  void Start(const ServerOptions& options) {
    daemon_.reset();
    absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
        testing::TestDaemon::Start(geometry_, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    stub_ = v1::Attention::NewStub(
        grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
  }

  grpc::Status Register(const std::string& name, uint64_t offset, uint64_t bytes, std::string* id) {
    v1::RegisterRegionRequest request;
    request.mutable_system_shm()->set_name(name);
    request.mutable_system_shm()->set_offset(offset);
    request.mutable_system_shm()->set_byte_size(bytes);
    v1::RegisterRegionResponse response;
    grpc::ClientContext context;
    grpc::Status s = stub_->RegisterRegion(&context, request, &response);
    if (id != nullptr) *id = response.region_id();
    return s;
  }

  grpc::Status Unregister(const std::string& id) {
    v1::UnregisterRegionRequest request;
    request.set_region_id(id);
    v1::UnregisterRegionResponse response;
    grpc::ClientContext context;
    return stub_->UnregisterRegion(&context, request, &response);
  }

  grpc::Status Prefill(const v1::PrefillRequest& request, v1::PrefillResponse* response) {
    grpc::ClientContext context;
    return stub_->Prefill(&context, request, response);
  }

  std::string NewSequence() {
    absl::StatusOr<std::string> id = daemon_->client().CreateSequence();
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }

  // An inline fp32 tensor, or (with `shm`) the same values written at `offset` and referenced.
  v1::Tensor Tensor(const std::vector<int64_t>& shape, const std::vector<float>& values,
                    const std::string& region = "", char* shm = nullptr, uint64_t offset = 0) {
    v1::Tensor t;
    t.set_dtype(v1::DTYPE_FP32);
    for (int64_t d : shape) t.add_shape(d);
    const size_t bytes = values.size() * sizeof(float);
    if (region.empty()) {
      t.set_data(values.data(), bytes);
    } else {
      std::memcpy(shm + offset, values.data(), bytes);
      t.mutable_region()->set_region_id(region);
      t.mutable_region()->set_offset(offset);
      t.mutable_region()->set_byte_size(bytes);
    }
    return t;
  }

  testing::ModelGeometry geometry_;
  std::unique_ptr<testing::TestDaemon> daemon_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

TEST_F(RegionsTest, ShmRegionsGiveTheSameOutputsAsInlineBytes) {
  Shm shm(kShmBytes);
  std::string region;
  ASSERT_TRUE(Register(shm.name(), 0, kShmBytes, &region).ok());
  const int64_t t = 40, hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads,
                d = geometry_.head_dim;
  std::mt19937 rng(7);
  const std::vector<float> q = testing::RandomInputs(&rng, t * 5 * hq * d);
  const std::vector<float> k = testing::RandomInputs(&rng, t * hkv * d);
  const std::vector<float> v = testing::RandomInputs(&rng, t * hkv * d);
  const std::string inline_seq = NewSequence(), region_seq = NewSequence();

  v1::PrefillRequest a;
  a.set_sequence_id(inline_seq);
  *a.mutable_q() = Tensor({t, 5, hq, d}, q);
  *a.mutable_k() = Tensor({t, hkv, d}, k);
  *a.mutable_v() = Tensor({t, hkv, d}, v);
  v1::PrefillResponse ra;
  ASSERT_TRUE(Prefill(a, &ra).ok());

  const uint64_t q_off = 0, k_off = q.size() * 4, v_off = k_off + k.size() * 4,
                 o_off = v_off + v.size() * 4;
  v1::PrefillRequest b;
  b.set_sequence_id(region_seq);
  *b.mutable_q() = Tensor({t, 5, hq, d}, q, region, shm.base(), q_off);
  *b.mutable_k() = Tensor({t, hkv, d}, k, region, shm.base(), k_off);
  *b.mutable_v() = Tensor({t, hkv, d}, v, region, shm.base(), v_off);
  b.mutable_output_region()->set_region_id(region);
  b.mutable_output_region()->set_offset(o_off);
  b.mutable_output_region()->set_byte_size(t * hq * d * 4);
  v1::PrefillResponse rb;
  grpc::Status s = Prefill(b, &rb);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(rb.length(), t);
  EXPECT_TRUE(rb.o().data().empty());  // the bytes went to the region
  EXPECT_EQ(rb.o().region().region_id(), region);
  EXPECT_EQ(rb.o().region().offset(), o_off);
  ASSERT_EQ(rb.o().shape_size(), 3);
  ASSERT_EQ(ra.o().data().size(), static_cast<size_t>(t * hq * d * 4));
  EXPECT_EQ(std::memcmp(shm.base() + o_off, ra.o().data().data(), ra.o().data().size()), 0);

  // A decode step: region inputs and output, and an inline entry in the same call.
  const std::vector<float> dq = testing::RandomInputs(&rng, 3 * hq * d);
  const std::vector<float> dk = testing::RandomInputs(&rng, hkv * d);
  const std::vector<float> dv = testing::RandomInputs(&rng, hkv * d);
  v1::DecodeRequest decode;
  decode.set_layer(0);
  v1::DecodeEntry* e0 = decode.add_entries();
  e0->set_sequence_id(inline_seq);
  *e0->mutable_q() = Tensor({3, hq, d}, dq);
  *e0->mutable_k() = Tensor({hkv, d}, dk);
  *e0->mutable_v() = Tensor({hkv, d}, dv);
  const uint64_t base = 512 * 1024;
  v1::DecodeEntry* e1 = decode.add_entries();
  e1->set_sequence_id(region_seq);
  *e1->mutable_q() = Tensor({3, hq, d}, dq, region, shm.base(), base);
  *e1->mutable_k() = Tensor({hkv, d}, dk, region, shm.base(), base + dq.size() * 4);
  *e1->mutable_v() = Tensor({hkv, d}, dv, region, shm.base(), base + (dq.size() + dk.size()) * 4);
  const uint64_t out = base + 64 * 1024;
  e1->mutable_output_region()->set_region_id(region);
  e1->mutable_output_region()->set_offset(out);
  e1->mutable_output_region()->set_byte_size(hq * d * 4);
  v1::DecodeResponse dr;
  grpc::ClientContext context;
  s = stub_->Decode(&context, decode, &dr);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(dr.outputs_size(), 2);
  EXPECT_EQ(dr.outputs(1).length(), t + 1);
  EXPECT_TRUE(dr.outputs(1).o().data().empty());
  ASSERT_EQ(dr.outputs(0).o().data().size(), static_cast<size_t>(hq * d * 4));
  EXPECT_EQ(std::memcmp(shm.base() + out, dr.outputs(0).o().data().data(), hq * d * 4), 0);

  // Unregistered: the id is gone.
  EXPECT_TRUE(Unregister(region).ok());
  v1::PrefillResponse rc;
  EXPECT_EQ(Prefill(b, &rc).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(RegionsTest, BadReferencesAreRefusedAndChangeNothing) {
  Shm shm(kShmBytes);
  std::string region;
  ASSERT_TRUE(Register(shm.name(), 0, kShmBytes, &region).ok());
  const int64_t t = 4, hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads,
                d = geometry_.head_dim;
  std::mt19937 rng(8);
  const std::vector<float> q = testing::RandomInputs(&rng, t * 5 * hq * d);
  const std::vector<float> k = testing::RandomInputs(&rng, t * hkv * d);
  const std::vector<float> v = testing::RandomInputs(&rng, t * hkv * d);
  const std::string seq = NewSequence();
  auto good = [&] {
    v1::PrefillRequest r;
    r.set_sequence_id(seq);
    *r.mutable_q() = Tensor({t, 5, hq, d}, q, region, shm.base(), 0);
    *r.mutable_k() = Tensor({t, hkv, d}, k, region, shm.base(), 65536);
    *r.mutable_v() = Tensor({t, hkv, d}, v, region, shm.base(), 131072);
    return r;
  };
  struct Case {
    std::string what;
    std::function<void(v1::PrefillRequest*)> edit;
    grpc::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"past the end",
       [&](v1::PrefillRequest* r) { r->mutable_k()->mutable_region()->set_offset(kShmBytes - 8); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"offset overflow",
       [&](v1::PrefillRequest* r) {
         r->mutable_k()->mutable_region()->set_offset(~uint64_t{0} - 3);
       },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"misaligned",
       [&](v1::PrefillRequest* r) { r->mutable_v()->mutable_region()->set_offset(2); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"byte size not the shape's",
       [&](v1::PrefillRequest* r) { r->mutable_v()->mutable_region()->set_byte_size(16); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"unknown region",
       [&](v1::PrefillRequest* r) {
         r->mutable_q()->mutable_region()->set_region_id(std::string(32, 'b'));
       },
       grpc::StatusCode::NOT_FOUND},
      {"malformed id",
       [&](v1::PrefillRequest* r) { r->mutable_q()->mutable_region()->set_region_id("../x"); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"data and region", [&](v1::PrefillRequest* r) { r->mutable_q()->set_data("abcd"); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"output overlapping an input",
       [&](v1::PrefillRequest* r) {
         r->mutable_output_region()->set_region_id(region);
         r->mutable_output_region()->set_offset(65536 + 64);  // inside k
         r->mutable_output_region()->set_byte_size(t * hq * d * 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"output of the wrong size",
       [&](v1::PrefillRequest* r) {
         r->mutable_output_region()->set_region_id(region);
         r->mutable_output_region()->set_offset(262144);
         r->mutable_output_region()->set_byte_size(8);
       },
       grpc::StatusCode::INVALID_ARGUMENT},
  };
  for (const Case& c : cases) {
    v1::PrefillRequest r = good();
    c.edit(&r);
    v1::PrefillResponse response;
    grpc::Status s = Prefill(r, &response);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    EXPECT_FALSE(s.error_message().empty()) << c.what;
  }
  // Nothing changed: the sequence is still empty, and a good request now appends at 0.
  v1::PrefillResponse ok;
  ASSERT_TRUE(Prefill(good(), &ok).ok());
  EXPECT_EQ(ok.length(), t);

  // Truncated after registration: FAILED_PRECONDITION, and the layer did not advance.
  const v1::PrefillRequest again = good();  // written before the truncation (this process too
                                            // would get SIGBUS past the new end)
  shm.Truncate(4096);
  v1::PrefillResponse truncated;
  grpc::Status s = Prefill(again, &truncated);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("shrank"), std::string::npos) << s.error_message();

  // Registration errors.
  EXPECT_EQ(Register("/attnd-no-such-object", 0, 4096, nullptr).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register(shm.name(), 0, kShmBytes, nullptr).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);  // now smaller than claimed
  EXPECT_EQ(Register("../../etc/passwd", 0, 4096, nullptr).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Unregister(std::string(32, 'c')).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(RegionsTest, IdleRegionsAreReclaimed) {
  Shm shm(kShmBytes);
  std::string region;
  ASSERT_TRUE(Register(shm.name(), 0, kShmBytes, &region).ok());
  v1::GetServerInfoResponse info;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  }
  EXPECT_EQ(info.regions().idle_timeout_seconds(), 2);
  ASSERT_GE(info.regions().kinds_size(), 1);
  EXPECT_EQ(info.regions().kinds(0), v1::REGION_KIND_SYSTEM_SHM);
  EXPECT_FALSE(info.regions().host_boot_id().empty());
  EXPECT_TRUE(info.regions().rings());
  // The reclaimer runs every second; the timeout is 2 s.
  absl::SleepFor(absl::Milliseconds(4500));
  EXPECT_EQ(Unregister(region).error_code(), grpc::StatusCode::NOT_FOUND);
}

// The client's half of the ring protocol, written from shm_ring.h alone.
class HandRing {
 public:
  // slots > 1: a version 2 ring with that many pairs of halves.
  explicit HandRing(uint64_t half, const std::string& prefix = "/attnd-", uint32_t slots = 1)
      : half_(half), slots_(slots), shm_(ring::kHeaderBytes + 2 * slots * half, prefix) {
    auto* h = header();
    h->magic = ring::kMagic;
    h->version = slots > 1 ? ring::v2::kVersion : ring::kVersion;
    h->slots = slots > 1 ? slots : 0;
    h->half_bytes = half;
  }
  ring::Header* header() { return reinterpret_cast<ring::Header*>(shm_.base()); }
  const std::string& name() const { return shm_.name(); }
  uint64_t bytes() const { return ring::kHeaderBytes + 2 * slots_ * half_; }

  // Writes request `seq` into its slot.
  void Write(uint32_t seq, const std::string& request) {
    char* half = shm_.base() + ring::kHeaderBytes + 2 * (seq % slots_) * half_;
    const uint64_t n = request.size();
    std::memcpy(half, &n, 8);
    std::memcpy(half + 8, request.data(), n);
  }
  // Sets request_seq and rings.
  void Publish(uint32_t seq) {
    ring::Header* h = header();
    h->request_seq.store(seq, std::memory_order_seq_cst);
    ring::FutexWake(&h->request_seq);
  }
  // Both, without waiting for anything.
  void Post(uint32_t seq, const std::string& request) {
    Write(seq, request);
    Publish(seq);
  }
  // What request `seq`'s slot's response half holds.
  std::string Response(uint32_t seq) {
    const char* half = shm_.base() + ring::kHeaderBytes + (2 * (seq % slots_) + 1) * half_;
    uint64_t n;
    std::memcpy(&n, half, 8);
    return std::string(half + 8, std::min<uint64_t>(n, half_ - 8));
  }

  // Writes raw request bytes, rings, waits (spin then futex) for the answer. `claimed`: the
  // length field to write instead of the request's size (a hostile client's).
  bool RoundTrip(const std::string& request, std::string* response, bool sleep_first,
                 std::optional<uint64_t> claimed = std::nullopt) {
    ring::Header* h = header();
    const uint32_t seq = h->request_seq.load() + 1;
    const uint64_t n = request.size(), field = claimed.value_or(n);
    std::memcpy(shm_.base() + ring::RequestOffset(), &field, 8);
    std::memcpy(shm_.base() + ring::RequestOffset() + 8, request.data(), n);
    if (sleep_first) absl::SleepFor(absl::Milliseconds(5));  // let the server fall asleep
    h->request_seq.store(seq, std::memory_order_seq_cst);
    if (h->server_sleeping.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&h->request_seq);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (h->response_seq.load(std::memory_order_acquire) != seq) {
      if (h->closed.load() != 0 || absl::Now() > deadline) return false;
      h->client_sleeping.store(1, std::memory_order_seq_cst);
      if (h->response_seq.load(std::memory_order_seq_cst) != seq) {
        ring::FutexWait(&h->response_seq, seq - 1, 100000);
      }
      h->client_sleeping.store(0);
    }
    uint64_t len;
    std::memcpy(&len, shm_.base() + ring::ResponseOffset(half_), 8);
    response->assign(shm_.base() + ring::ResponseOffset(half_) + 8, len);
    return true;
  }

  // Rings the doorbell without writing a request (after Truncate the halves are gone).
  void Ring() {
    ring::Header* h = header();
    h->request_seq.store(h->request_seq.load() + 1, std::memory_order_seq_cst);
    ring::FutexWake(&h->request_seq);
  }
  // Waits up to `timeout` for attnd to mark the ring closed.
  bool WaitClosed(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (header()->closed.load() == 0) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }
  void Truncate(size_t bytes) { shm_.Truncate(bytes); }

 private:
  uint64_t half_;
  uint32_t slots_;
  Shm shm_;
};

TEST_F(RegionsTest, RingCarriesSessionRequests) {
  HandRing hand(256 * 1024);
  v1::OpenRingRequest open;
  open.set_name(hand.name());
  open.set_byte_size(hand.bytes());
  v1::OpenRingResponse opened;
  {
    grpc::ClientContext context;
    grpc::Status s = stub_->OpenRing(&context, open, &opened);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(opened.request_capacity(), 256 * 1024 - 8u);

  const int64_t t = 20, hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads,
                d = geometry_.head_dim;
  std::mt19937 rng(9);
  const std::string ring_seq = NewSequence(), grpc_seq = NewSequence();
  for (int step = 0; step < 6; ++step) {
    const bool prefill = step == 0;
    const int64_t n = prefill ? t : 1;
    const std::vector<float> q = testing::RandomInputs(&rng, n * (prefill ? 5 : 3) * hq * d);
    const std::vector<float> k = testing::RandomInputs(&rng, n * hkv * d);
    const std::vector<float> v = testing::RandomInputs(&rng, n * hkv * d);
    v1::SessionRequest request;
    request.set_tag(100 + step);
    std::string want;
    if (prefill) {
      v1::PrefillRequest* p = request.mutable_prefill();
      *p->mutable_q() = Tensor({t, 5, hq, d}, q);
      *p->mutable_k() = Tensor({t, hkv, d}, k);
      *p->mutable_v() = Tensor({t, hkv, d}, v);
      p->set_sequence_id(grpc_seq);
      v1::PrefillResponse r;
      ASSERT_TRUE(Prefill(*p, &r).ok());
      want = r.o().data();
      p->set_sequence_id(ring_seq);
    } else {
      v1::DecodeEntry* e = request.mutable_decode()->add_entries();
      *e->mutable_q() = Tensor({3, hq, d}, q);
      *e->mutable_k() = Tensor({hkv, d}, k);
      *e->mutable_v() = Tensor({hkv, d}, v);
      e->set_sequence_id(grpc_seq);
      v1::DecodeResponse r;
      grpc::ClientContext context;
      ASSERT_TRUE(stub_->Decode(&context, request.decode(), &r).ok());
      want = r.outputs(0).o().data();
      request.mutable_decode()->mutable_entries(0)->set_sequence_id(ring_seq);
    }
    std::string bytes;
    ASSERT_TRUE(hand.RoundTrip(request.SerializeAsString(), &bytes, /*sleep_first=*/step % 2 == 1))
        << "step " << step;
    v1::SessionResponse response;
    ASSERT_TRUE(response.ParseFromString(bytes));
    EXPECT_EQ(response.tag(), static_cast<uint64_t>(100 + step));
    ASSERT_EQ(response.code(), 0) << response.message();
    const std::string& got =
        prefill ? response.prefill().o().data() : response.decode().outputs(0).o().data();
    EXPECT_EQ(got, want) << "step " << step;
  }
  // Garbage in the ring: answered INVALID_ARGUMENT, and the ring goes on.
  std::string bytes;
  ASSERT_TRUE(hand.RoundTrip("\xff\xff\xff garbage", &bytes, false));
  v1::SessionResponse bad;
  ASSERT_TRUE(bad.ParseFromString(bytes));
  EXPECT_EQ(bad.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  // An unknown sequence: its own error, in the response.
  v1::SessionRequest unknown;
  v1::DecodeEntry* e = unknown.mutable_decode()->add_entries();
  e->set_sequence_id(std::string(32, 'e'));
  *e->mutable_q() = Tensor({3, hq, d}, std::vector<float>(3 * hq * d));
  *e->mutable_k() = Tensor({hkv, d}, std::vector<float>(hkv * d));
  *e->mutable_v() = Tensor({hkv, d}, std::vector<float>(hkv * d));
  ASSERT_TRUE(hand.RoundTrip(unknown.SerializeAsString(), &bytes, false));
  ASSERT_TRUE(bad.ParseFromString(bytes));
  EXPECT_EQ(bad.code(), static_cast<int>(grpc::StatusCode::NOT_FOUND)) << bad.message();

  // Closing: the client sees `closed`; the id is gone.
  v1::CloseRingRequest close;
  close.set_ring_id(opened.ring_id());
  v1::CloseRingResponse closed;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->CloseRing(&context, close, &closed).ok());
  }
  EXPECT_EQ(hand.header()->closed.load(), 1u);
  {
    grpc::ClientContext context;
    EXPECT_EQ(stub_->CloseRing(&context, close, &closed).error_code(), grpc::StatusCode::NOT_FOUND);
  }
}

// Decodes from several rings at once join one batcher: with one batch in flight per layer, calls
// that arrive while it runs are merged, whichever ring they came from.
TEST_F(RegionsTest, RingDecodesFromSeveralClientsAreBatchedTogether) {
  ServerOptions options = testing::SmallCpuOptions();
  options.compute_threads = 1;
  options.decode_batches_in_flight = 1;
  options.max_queue_delay_us = 2000;
  options.cuda_graph_batch_sizes = "8";
  Start(options);
  constexpr int kRings = 4, kSteps = 40;
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  std::vector<std::unique_ptr<HandRing>> rings;
  std::vector<std::string> seqs;
  std::mt19937 rng(11);
  for (int r = 0; r < kRings; ++r) {
    rings.push_back(std::make_unique<HandRing>(64 * 1024));
    v1::OpenRingRequest open;
    open.set_name(rings.back()->name());
    open.set_byte_size(rings.back()->bytes());
    v1::OpenRingResponse opened;
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->OpenRing(&context, open, &opened).ok());
    seqs.push_back(NewSequence());
    v1::PrefillRequest p;
    p.set_sequence_id(seqs.back());
    *p.mutable_q() = Tensor({8, 5, hq, d}, testing::RandomInputs(&rng, 8 * 5 * hq * d));
    *p.mutable_k() = Tensor({8, hkv, d}, testing::RandomInputs(&rng, 8 * hkv * d));
    *p.mutable_v() = Tensor({8, hkv, d}, testing::RandomInputs(&rng, 8 * hkv * d));
    v1::PrefillResponse pr;
    ASSERT_TRUE(Prefill(p, &pr).ok());
  }
  std::vector<std::string> requests(kRings);
  for (int r = 0; r < kRings; ++r) {
    v1::SessionRequest request;
    v1::DecodeEntry* e = request.mutable_decode()->add_entries();
    e->set_sequence_id(seqs[r]);
    *e->mutable_q() = Tensor({3, hq, d}, testing::RandomInputs(&rng, 3 * hq * d));
    *e->mutable_k() = Tensor({hkv, d}, testing::RandomInputs(&rng, hkv * d));
    *e->mutable_v() = Tensor({hkv, d}, testing::RandomInputs(&rng, hkv * d));
    requests[r] = request.SerializeAsString();
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> clients;
  for (int r = 0; r < kRings; ++r) {
    clients.emplace_back([&, r] {
      for (int step = 0; step < kSteps; ++step) {
        std::string bytes;
        v1::SessionResponse response;
        if (!rings[r]->RoundTrip(requests[r], &bytes, false) || !response.ParseFromString(bytes) ||
            response.code() != 0 || response.decode().outputs(0).length() != 8 + step + 1) {
          failures.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(failures.load(), 0);
  absl::StatusOr<v1::GetServerInfoResponse> info = daemon_->client().Info();
  ASSERT_TRUE(info.ok());
  const v1::DecodeBatchingStats& b = info->decode_batching();
  EXPECT_EQ(b.calls_submitted(), kRings * kSteps);
  EXPECT_EQ(b.entries(), kRings * kSteps);
  // At least some calls of different rings shared a batch.
  EXPECT_LT(b.batches(), b.entries()) << "no two ring decodes were merged";
}

TEST_F(RegionsTest, BadRingsAreRefused) {
  HandRing hand(64 * 1024);
  auto open = [&](uint64_t bytes) {
    v1::OpenRingRequest request;
    request.set_name(hand.name());
    request.set_byte_size(bytes);
    v1::OpenRingResponse response;
    grpc::ClientContext context;
    return stub_->OpenRing(&context, request, &response);
  };
  EXPECT_EQ(open(hand.bytes() + 2).error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // too big
  EXPECT_EQ(open(hand.bytes() - 2).error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // halves
  hand.header()->magic = 42;
  grpc::Status s = open(hand.bytes());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("magic"), std::string::npos) << s.error_message();
  hand.header()->magic = ring::kMagic;
  hand.header()->request_seq.store(5);
  EXPECT_EQ(open(hand.bytes()).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  hand.header()->request_seq.store(0);
  EXPECT_TRUE(open(hand.bytes()).ok());
}

// Opens `hand` as a ring; the ring id, or "" (with a test failure).
std::string OpenRing(v1::Attention::Stub* stub, HandRing* hand) {
  v1::OpenRingRequest open;
  open.set_name(hand->name());
  open.set_byte_size(hand->bytes());
  v1::OpenRingResponse opened;
  grpc::ClientContext context;
  grpc::Status s = stub->OpenRing(&context, open, &opened);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return opened.ring_id();
}

grpc::StatusCode CloseRing(v1::Attention::Stub* stub, const std::string& id) {
  v1::CloseRingRequest close;
  close.set_ring_id(id);
  v1::CloseRingResponse closed;
  grpc::ClientContext context;
  return stub->CloseRing(&context, close, &closed).error_code();
}

// A length field past the request half (up to 2^64 - 1) is answered INVALID_ARGUMENT with the
// half's capacity, nothing is read past the half, and the ring serves the next request.
TEST_F(RegionsTest, RingLengthFieldsPastTheHalfAreRefused) {
  HandRing hand(64 * 1024);
  const std::string id = OpenRing(stub_.get(), &hand);
  const uint64_t capacity = 64 * 1024 - 8;
  v1::SessionRequest unknown;
  unknown.set_tag(7);
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  v1::DecodeEntry* e = unknown.mutable_decode()->add_entries();
  e->set_sequence_id(std::string(32, 'e'));
  *e->mutable_q() = Tensor({3, hq, d}, std::vector<float>(3 * hq * d));
  *e->mutable_k() = Tensor({hkv, d}, std::vector<float>(hkv * d));
  *e->mutable_v() = Tensor({hkv, d}, std::vector<float>(hkv * d));
  const std::string request = unknown.SerializeAsString();
  for (const uint64_t claimed : {capacity + 1, uint64_t{1} << 40, ~uint64_t{0}}) {
    SCOPED_TRACE(claimed);
    std::string bytes;
    ASSERT_TRUE(hand.RoundTrip(request, &bytes, false, claimed));
    v1::SessionResponse response;
    ASSERT_TRUE(response.ParseFromString(bytes));
    EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    EXPECT_NE(response.message().find(absl::StrCat("says ", claimed, " bytes")), std::string::npos)
        << response.message();
    EXPECT_NE(response.message().find(absl::StrCat("(", capacity, ")")), std::string::npos)
        << response.message();
  }
  // A length of exactly the capacity is read (and here does not parse); then a real request.
  std::string bytes;
  ASSERT_TRUE(hand.RoundTrip(request, &bytes, false, capacity));
  v1::SessionResponse response;
  ASSERT_TRUE(response.ParseFromString(bytes));
  EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(response.message().find("cannot parse"), std::string::npos) << response.message();
  ASSERT_TRUE(hand.RoundTrip(request, &bytes, false));
  ASSERT_TRUE(response.ParseFromString(bytes));
  EXPECT_EQ(response.tag(), 7u);
  EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::NOT_FOUND)) << response.message();
  EXPECT_EQ(CloseRing(stub_.get(), id), grpc::StatusCode::OK);
}

// A client that shrinks its ring's shm object under attnd: the ring's thread hits SIGBUS reading
// the request half, the guard turns it into a broken ring, and the housekeeping closes it at its
// next pass (within about a second, not after the idle timeout). The daemon goes on serving.
TEST_F(RegionsTest, ARingWhoseObjectShrinksIsClosedAndTheDaemonServesOn) {
  ServerOptions options = testing::SmallCpuOptions();
  options.region_idle_timeout = absl::Seconds(60);  // so only the broken path can close it
  options.ring_spin = absl::Microseconds(20);
  Start(options);
  HandRing hand(64 * 1024);
  const std::string id = OpenRing(stub_.get(), &hand);
  std::string bytes;
  ASSERT_TRUE(hand.RoundTrip("\xff garbage", &bytes, false));  // the ring works
  hand.Truncate(ring::kHeaderBytes);                           // the halves are gone
  hand.Ring();
  EXPECT_TRUE(hand.WaitClosed(absl::Seconds(10))) << "the broken ring was not closed";
  EXPECT_EQ(CloseRing(stub_.get(), id), grpc::StatusCode::NOT_FOUND);
  // Another ring, and the unary API, still work.
  HandRing next(64 * 1024);
  const std::string next_id = OpenRing(stub_.get(), &next);
  ASSERT_TRUE(next.RoundTrip("\xff garbage", &bytes, false));
  v1::SessionResponse response;
  ASSERT_TRUE(response.ParseFromString(bytes));
  EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_FALSE(NewSequence().empty());
  EXPECT_EQ(CloseRing(stub_.get(), next_id), grpc::StatusCode::OK);
}

// A ring no request used for the idle timeout (2 s here; a client that died holding it) is
// closed, and not before that.
TEST_F(RegionsTest, IdleRingsAreClosed) {
  HandRing hand(64 * 1024);
  const std::string id = OpenRing(stub_.get(), &hand);
  std::string bytes;
  ASSERT_TRUE(hand.RoundTrip("\xff garbage", &bytes, false));
  const absl::Time last_used = absl::Now();
  EXPECT_FALSE(hand.WaitClosed(absl::Milliseconds(1500))) << "closed before its idle timeout";
  EXPECT_TRUE(hand.WaitClosed(absl::Seconds(10))) << "the idle ring was not closed";
  EXPECT_GE(absl::Now() - last_used, absl::Seconds(2));
  EXPECT_EQ(CloseRing(stub_.get(), id), grpc::StatusCode::NOT_FOUND);
}

namespace hardening {

// Resident set size of this process (the daemon runs in it), in bytes.
int64_t Rss() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

}  // namespace hardening

// A reference costs the client a few bytes; the copy it names costs attnd its size. So every
// reference is judged by what it claims (dtype, shape against the model, byte_size, the message
// limit) and its copies are counted in --max-inflight-request-bytes before a byte is copied: a
// client naming 48 GiB of a sparse object gets an error, never a crash or gigabytes of RSS.
TEST_F(RegionsTest, ReferencesAreJudgedBeforeAnyRegionMemoryIsCopied) {
  ServerOptions options = testing::SmallCpuOptions();
  options.max_message_bytes = 4 << 20;
  options.max_inflight_request_bytes = 4 << 20;
  options.grpc_memory_bytes = 64 << 20;
  Start(options);
  const uint64_t kBig = uint64_t{48} << 30;  // sparse: costs nothing until read
  Shm big(kBig);
  std::string region;
  ASSERT_TRUE(Register(big.name(), 0, kBig, &region).ok());
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const std::string seq = NewSequence();
  auto ref = [&](v1::Tensor* t, std::vector<int64_t> shape, uint64_t offset, uint64_t bytes) {
    t->set_dtype(v1::DTYPE_FP32);
    t->clear_shape();
    for (int64_t x : shape) t->add_shape(x);
    t->mutable_region()->set_region_id(region);
    t->mutable_region()->set_offset(offset);
    t->mutable_region()->set_byte_size(bytes);
  };
  const int64_t rss_before = hardening::Rss();
  struct Case {
    std::string what;
    std::function<void(v1::PrefillRequest*)> edit;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> prefills = {
      {"a negative dimension naming 48 GiB",
       [&](v1::PrefillRequest* r) {
         ref(r->mutable_q(), {-1, 5, hq, d}, 0, kBig);
         ref(r->mutable_k(), {-1, hkv, d}, 0, kBig);
         ref(r->mutable_v(), {-1, hkv, d}, 0, kBig);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "q must have shape"},
      {"a tensor past the message limit",
       [&](v1::PrefillRequest* r) {
         const int64_t t = 4000;  // 20 MB of q, within the model's 4096 tokens
         ref(r->mutable_q(), {t, 5, hq, d}, 0, t * 5 * hq * d * 4);
         ref(r->mutable_k(), {t, hkv, d}, uint64_t{1} << 30, t * hkv * d * 4);
         ref(r->mutable_v(), {t, hkv, d}, uint64_t{2} << 30, t * hkv * d * 4);
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-message-bytes"},
      {"an output region sized by an unchecked T",
       [&](v1::PrefillRequest* r) {
         const int64_t t = int64_t{1} << 24;
         r->mutable_q()->set_dtype(v1::DTYPE_FP32);
         for (int64_t x : {t, int64_t{5}, hq, d}) r->mutable_q()->add_shape(x);
         for (v1::Tensor* kv : {r->mutable_k(), r->mutable_v()}) {
           kv->set_dtype(v1::DTYPE_FP32);
           for (int64_t x : {t, hkv, d}) kv->add_shape(x);
         }
         r->mutable_output_region()->set_region_id(region);
         r->mutable_output_region()->set_offset(0);
         r->mutable_output_region()->set_byte_size(t * hq * d * 4);
       },
       grpc::StatusCode::OUT_OF_RANGE, "maximum sequence length"},
  };
  for (const Case& c : prefills) {
    v1::PrefillRequest r;
    r.set_sequence_id(seq);
    c.edit(&r);
    v1::PrefillResponse response;
    grpc::Status s = Prefill(r, &response);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.message), std::string::npos)
        << c.what << ": " << s.error_message();
  }
  // Decode: four entries that each claim 256 MiB, then 2,000 well-formed entries that together
  // name 8 MB of copies, twice the budget.
  // n entries whose q claims `q_shape` (q_bytes), k and v well formed, all in the big region.
  auto decode = [&](int n, const std::function<std::string(int)>& id,
                    const std::vector<int64_t>& q_shape, uint64_t q_bytes) {
    v1::DecodeRequest request;
    for (int i = 0; i < n; ++i) {
      v1::DecodeEntry* e = request.add_entries();
      e->set_sequence_id(id(i));
      ref(e->mutable_q(), q_shape, 0, q_bytes);
      ref(e->mutable_k(), {hkv, d}, uint64_t{1} << 30, hkv * d * 4);
      ref(e->mutable_v(), {hkv, d}, uint64_t{2} << 30, hkv * d * 4);
    }
    v1::DecodeResponse response;
    grpc::ClientContext context;
    return stub_->Decode(&context, request, &response);
  };
  grpc::Status s = decode(
      4, [&](int) { return seq; }, {3, hq, d * 1024 * 8}, uint64_t{256} << 20);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("entries[0]: q must have shape"), std::string::npos)
      << s.error_message();
  s = decode(
      2000, [](int i) { return absl::StrCat(std::string(24, 'a'), absl::Hex(i, absl::kZeroPad8)); },
      {3, hq, d}, 3 * hq * d * 4);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("--max-inflight-request-bytes"), std::string::npos)
      << s.error_message();
  EXPECT_LT(hardening::Rss() - rss_before, int64_t{256} << 20);
  // Nothing was changed and no budget was kept: a good request of the budget's size still runs.
  const int64_t t = 100;  // 512 KB of q
  std::mt19937 rng(11);
  const std::vector<float> q = testing::RandomInputs(&rng, t * 5 * hq * d);
  const std::vector<float> k = testing::RandomInputs(&rng, t * hkv * d);
  v1::PrefillRequest good;
  good.set_sequence_id(seq);
  *good.mutable_q() = Tensor({t, 5, hq, d}, q, region, big.base(), 0);
  *good.mutable_k() = Tensor({t, hkv, d}, k, region, big.base(), uint64_t{1} << 30);
  *good.mutable_v() = Tensor({t, hkv, d}, k, region, big.base(), uint64_t{2} << 30);
  v1::PrefillResponse response;
  s = Prefill(good, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.length(), t);
}

// A ring's request is a message: no longer than --max-message-bytes, and its copy is request
// bytes. A garbage length of most of the half must not make attnd keep a private copy of that size
// for the ring's life.
TEST_F(RegionsTest, RingRequestsAreBoundByTheMessageLimit) {
  ServerOptions options = testing::SmallCpuOptions();
  options.max_message_bytes = 1 << 20;
  options.max_inflight_request_bytes = 1 << 20;
  Start(options);
  HandRing hand(16 << 20);
  v1::OpenRingRequest open;
  open.set_name(hand.name());
  open.set_byte_size(hand.bytes());
  v1::OpenRingResponse opened;
  {
    grpc::ClientContext context;
    grpc::Status s = stub_->OpenRing(&context, open, &opened);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  const int64_t rss_before = hardening::Rss();
  std::string bytes;
  ASSERT_TRUE(hand.RoundTrip("garbage", &bytes, false, uint64_t{12} << 20));
  v1::SessionResponse response;
  ASSERT_TRUE(response.ParseFromString(bytes));
  EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED))
      << response.message();
  EXPECT_NE(response.message().find("--max-message-bytes"), std::string::npos)
      << response.message();
  EXPECT_LT(hardening::Rss() - rss_before, int64_t{8} << 20);
  // The ring goes on.
  ASSERT_TRUE(hand.RoundTrip("\xff garbage", &bytes, false));
  ASSERT_TRUE(response.ParseFromString(bytes));
  EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
}

// Spinning costs a core while it lasts: many rings of one tenant, all busy, never have more than
// RingOptions::max_spinning_per_tenant threads spinning at once, nor all tenants more than
// max_spinning (the others sleep on the futex and still answer).
TEST(RingSpinTest, SpinningIsRationedPerTenantAndInTotal) {
  RegionRegistry registry(RegionRegistryOptions{}, nullptr, Clock::Real());
  RingOptions options;
  options.spin = absl::Milliseconds(2);
  options.answer_spin = absl::Milliseconds(2);
  options.max_spinning_per_tenant = 1;
  options.max_spinning = 2;
  RingServer rings(&registry, options);
  rings.SetHandler([](const v1::SessionRequest& request, absl::string_view,
                      v1::SessionResponse* response, std::function<void(absl::Status)> done) {
    // Answered from another thread a little later, as a batch elsewhere would be.
    std::thread([done = std::move(done)] {
      absl::SleepFor(absl::Microseconds(200));
      done(absl::OkStatus());
    }).detach();
    return absl::OkStatus();
  });
  constexpr int kRingsPerTenant = 4, kRequests = 100;
  std::vector<std::unique_ptr<HandRing>> hands;
  std::vector<std::thread> clients;
  std::atomic<int> answered{0};
  for (const std::string tenant : {"a", "b", "c"}) {
    for (int r = 0; r < kRingsPerTenant; ++r) {
      hands.push_back(std::make_unique<HandRing>(64 * 1024, ShmNamePrefix(tenant)));
      absl::StatusOr<RingServer::Opened> opened =
          rings.Open(tenant, hands.back()->name(), hands.back()->bytes());
      ASSERT_TRUE(opened.ok()) << opened.status();
    }
  }
  for (auto& hand : hands) {
    clients.emplace_back([&answered, h = hand.get()] {
      v1::SessionRequest request;
      for (int i = 0; i < kRequests; ++i) {
        request.set_tag(i);
        std::string bytes;
        if (h->RoundTrip(request.SerializeAsString(), &bytes, false)) answered.fetch_add(1);
      }
    });
  }
  for (std::thread& c : clients) c.join();
  EXPECT_EQ(answered.load(), static_cast<int>(hands.size()) * kRequests);
  const RingSpinStats stats = rings.spin_stats();
  EXPECT_LE(stats.max_spinning_one_tenant_seen, 1);
  EXPECT_LE(stats.max_spinning_seen, 2);
  EXPECT_GT(stats.spins, 0);
  EXPECT_GT(stats.spins_refused, 0);
  rings.Shutdown();
}

// A request whose output region shrinks while the engine runs fails FAILED_PRECONDITION and
// changes nothing: the staged output is copied before the runtime commits, so the tokens are not
// appended (prefill and decode).
TEST_F(RegionsTest, AnOutputRegionThatShrinksFailsTheCallAndChangesNothing) {
  FaultEngine* fault = nullptr;
  ServerOptions options = testing::SmallCpuOptions();
  options.wrap_engine = [&fault](std::unique_ptr<Engine> inner) -> std::unique_ptr<Engine> {
    auto engine = std::make_unique<FaultEngine>(std::move(inner));
    fault = engine.get();
    return engine;
  };
  Start(options);
  ASSERT_NE(fault, nullptr);
  const int64_t t = 8, hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads,
                d = geometry_.head_dim;
  std::mt19937 rng(12);
  const std::vector<float> q = testing::RandomInputs(&rng, t * 5 * hq * d);
  const std::vector<float> k = testing::RandomInputs(&rng, t * hkv * d);
  const std::string seq = NewSequence();
  Shm out(kShmBytes);
  std::string region;
  ASSERT_TRUE(Register(out.name(), 0, kShmBytes, &region).ok());
  v1::PrefillRequest request;
  request.set_sequence_id(seq);
  *request.mutable_q() = Tensor({t, 5, hq, d}, q);
  *request.mutable_k() = Tensor({t, hkv, d}, k);
  *request.mutable_v() = Tensor({t, hkv, d}, k);
  request.mutable_output_region()->set_region_id(region);
  request.mutable_output_region()->set_offset(kShmBytes / 2);
  request.mutable_output_region()->set_byte_size(t * hq * d * 4);
  fault->HoldPrefills();
  grpc::Status status;
  std::thread call([&] {
    v1::PrefillResponse response;
    status = Prefill(request, &response);
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (fault->held_prefills() == 0 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(fault->held_prefills(), 1);
  out.Truncate(4096);  // the output range is gone
  fault->ReleasePrefills();
  call.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_NE(status.error_message().find("nothing was changed"), std::string::npos)
      << status.error_message();
  // The layer did not advance: the same prompt sent inline appends at 0.
  request.clear_output_region();
  v1::PrefillResponse ok;
  ASSERT_TRUE(Prefill(request, &ok).ok());
  EXPECT_EQ(ok.length(), t);
}

// The turn to spin is held while spinning only: a ring of the tenant that sleeps (its client idle)
// leaves the turn to the tenant's busy ring, whose every spin is then granted.
TEST(RingSpinTest, ASleepingRingLeavesItsTurnToABusyOne) {
  RegionRegistry registry(RegionRegistryOptions{}, nullptr, Clock::Real());
  RingOptions options;
  options.spin = absl::Microseconds(200);
  options.max_spinning_per_tenant = 1;
  options.max_spinning = 1;
  RingServer rings(&registry, options);
  rings.SetHandler([](const v1::SessionRequest&, absl::string_view, v1::SessionResponse*,
                      std::function<void(absl::Status)> done) {
    done(absl::OkStatus());
    return absl::OkStatus();
  });
  HandRing idle(64 * 1024), busy(64 * 1024);
  for (HandRing* h : {&idle, &busy}) {
    ASSERT_TRUE(rings.Open("", h->name(), h->bytes()).ok());
  }
  std::string bytes;
  ASSERT_TRUE(idle.RoundTrip(v1::SessionRequest().SerializeAsString(), &bytes, false));
  absl::SleepFor(absl::Milliseconds(20));  // the idle ring's spin is over: it sleeps
  const RingSpinStats before = rings.spin_stats();
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(busy.RoundTrip(v1::SessionRequest().SerializeAsString(), &bytes, false));
  }
  const RingSpinStats after = rings.spin_stats();
  EXPECT_GE(after.spins - before.spins,
            190);  // one after each answer (the last may not have begun)
  EXPECT_EQ(after.spins_refused - before.spins_refused, 0);
  rings.Shutdown();
}

// Device-ordered rings without a GPU: an opener that hands out made-up events shows what the ring
// does with them. OpenRing creates a pair only where asked for, on a version 2 ring and an engine
// with events; a frame flagged kDeviceOrdered waits on the host for its ring's "ready" event and
// then reaches the handler with the "done" event, or is answered DEADLINE_EXCEEDED without
// reaching it if "ready" never completes; on a ring without events it is refused before the
// handler; closing the ring destroys both.
class FakeEvents : public DeviceMemoryOpener {
 public:
  absl::StatusOr<Mapping> OpenIpcHandle(absl::string_view) override {
    return absl::InvalidArgumentError("no CUDA here");
  }
  void CloseIpcHandle(void*) override {}
  absl::StatusOr<IpcEvent> CreateIpcEvent() override {
    MutexLock lock(&mu_);
    IpcEvent e;
    e.event = reinterpret_cast<void*>(static_cast<uintptr_t>(++created_));
    e.handle = absl::StrCat("event-", created_);
    return e;
  }
  void DestroyIpcEvent(void* event) override {
    MutexLock lock(&mu_);
    destroyed_.push_back(reinterpret_cast<uintptr_t>(event));
  }
  // An event completes after `polls_to_complete` queries (never when negative).
  absl::StatusOr<bool> IpcEventDone(void* event) override {
    MutexLock lock(&mu_);
    queried_.push_back(reinterpret_cast<uintptr_t>(event));
    return polls_to_complete_ >= 0 && ++polls_ > polls_to_complete_;
  }
  void CompleteAfter(int polls) {
    MutexLock lock(&mu_);
    polls_to_complete_ = polls;
    polls_ = 0;
  }
  std::vector<uintptr_t> queried() {
    MutexLock lock(&mu_);
    return queried_;
  }
  std::vector<uintptr_t> destroyed() {
    MutexLock lock(&mu_);
    return destroyed_;
  }

  // Gates, where enabled: a word per slot (its "device address" is the host one); ArmGate stands
  // for the gate's stream, writing the value at once while the client's stream "runs", never
  // while it is stuck.
  void EnableGates(uint64_t first_value) {
    MutexLock lock(&mu_);
    gates_ = true;
    words_[0] = first_value;
  }
  void SetClientStuck(bool stuck) {
    MutexLock lock(&mu_);
    stuck_ = stuck;
  }
  absl::StatusOr<Gate> CreateGate() override {
    MutexLock lock(&mu_);
    if (!gates_) return absl::FailedPreconditionError("no gates in this test");
    Gate g;
    g.slot = 0;
    g.stream = reinterpret_cast<void*>(uintptr_t{0x5eed});
    g.word = &words_[0];
    g.device_word = &words_[0];
    g.value = __atomic_load_n(&words_[0], __ATOMIC_ACQUIRE);
    return g;
  }
  absl::Status ArmGate(const Gate& gate, void* ready_event, uint64_t value) override {
    MutexLock lock(&mu_);
    arms_.push_back({reinterpret_cast<uintptr_t>(ready_event), value});
    if (!stuck_) __atomic_store_n(gate.word, value, __ATOMIC_RELEASE);
    return absl::OkStatus();
  }
  void DestroyGate(const Gate& gate, bool stuck) override {
    MutexLock lock(&mu_);
    destroyed_gates_.push_back({gate.slot, stuck});
  }
  uint64_t word() { return __atomic_load_n(&words_[0], __ATOMIC_ACQUIRE); }
  std::vector<std::pair<uintptr_t, uint64_t>> arms() {
    MutexLock lock(&mu_);
    return arms_;
  }
  std::vector<std::pair<int32_t, bool>> destroyed_gates() {
    MutexLock lock(&mu_);
    return destroyed_gates_;
  }

 private:
  Mutex mu_;
  bool gates_ ABSL_GUARDED_BY(mu_) = false;
  bool stuck_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t words_[1] = {0};
  std::vector<std::pair<uintptr_t, uint64_t>> arms_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int32_t, bool>> destroyed_gates_ ABSL_GUARDED_BY(mu_);
  int created_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uintptr_t> destroyed_ ABSL_GUARDED_BY(mu_);
  std::vector<uintptr_t> queried_ ABSL_GUARDED_BY(mu_);
  int polls_to_complete_ ABSL_GUARDED_BY(mu_) = 0;
  int polls_ ABSL_GUARDED_BY(mu_) = 0;
};

// A decode frame of one sequence with 4-byte inline q, k, v (the parser judges bounds, not shapes).
std::string TinyDecodeFrame(uint32_t flags) {
  namespace v2 = ring::v2;
  v2::RequestHeader h{};
  h.magic = v2::kRequestMagic;
  h.op = v2::kDecode;
  h.tag = 7;
  h.num_sequences = 1;
  h.flags = flags;
  h.ids_offset = sizeof(h);
  const uint64_t id_at = sizeof(h) + sizeof(v2::StrRef), data_at = 384;
  for (v2::Tensor* t : {&h.q, &h.k, &h.v}) {
    t->where = v2::kInline;
    t->rank = 1;
    t->dtype = 3;
    t->offset = data_at;
    t->bytes = 4;
    t->shape[0] = 1;
  }
  std::string frame(data_at + 4, '\0');
  std::memcpy(frame.data(), &h, sizeof(h));
  const v2::StrRef id{static_cast<uint32_t>(id_at), 1};
  std::memcpy(frame.data() + sizeof(h), &id, sizeof(id));
  frame[id_at] = 'a';
  return frame;
}

int32_t ResponseCode(const std::string& response, std::string* message) {
  ring::v2::ResponseHeader r{};
  std::memcpy(&r, response.data(), std::min(response.size(), sizeof(r)));
  if (r.message_offset + r.message_bytes <= response.size()) {
    *message = response.substr(r.message_offset, r.message_bytes);
  }
  return r.code;
}

// Installs handlers on `rings` that answer every frame with `answer` (version 1 requests with
// UNIMPLEMENTED) and remember what each frame carried for the device.
class FrameRecorder {
 public:
  struct Seen {
    ring::v2::Op op;
    bool ordered;
    void* done;
    const void* word;
    uint64_t value;
  };
  FrameRecorder(RingServer* rings, absl::Status answer) : answer_(std::move(answer)) {
    rings->SetHandler(
        [](const v1::SessionRequest&, absl::string_view, v1::SessionResponse*,
           std::function<void(absl::Status)>) { return absl::UnimplementedError("version 1"); });
    rings->SetFrameHandler([this](const RequestFrame& frame, absl::string_view, FrameAnswer*,
                                  std::function<void(absl::Status)> done) {
      {
        MutexLock lock(&mu_);
        seen_.push_back(
            {frame.op, frame.device_ordered, frame.done_event, frame.gate_word, frame.gate_value});
      }
      done(answer_);
      return absl::OkStatus();
    });
  }
  std::vector<Seen> seen() {
    MutexLock lock(&mu_);
    return seen_;
  }

 private:
  const absl::Status answer_;
  Mutex mu_;
  std::vector<Seen> seen_ ABSL_GUARDED_BY(mu_);
};

TEST(RingDeviceEventsTest, EventsAreCreatedOnlyWhereAskedAndReachTheHandler) {
  RegionRegistry registry(RegionRegistryOptions{}, nullptr, Clock::Real());
  RingOptions ring_options;
  ring_options.ready_timeout = absl::Milliseconds(50);
  RingServer rings(&registry, ring_options);
  FakeEvents events;
  FrameRecorder recorder(&rings, absl::UnavailableError("the test's handler runs nothing"));

  HandRing v2_ring(64 * 1024);
  v2_ring.header()->version = ring::v2::kVersion;
  // No events from the engine (the CPU backend, a sharded engine): FAILED_PRECONDITION.
  absl::StatusOr<RingServer::Opened> opened =
      rings.Open("", v2_ring.name(), v2_ring.bytes(), /*device_events=*/true);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
  EXPECT_THAT(std::string(opened.status().message()), ::testing::HasSubstr("one CUDA GPU"));

  rings.SetDeviceEvents(&events);
  HandRing v1_ring(64 * 1024);
  opened = rings.Open("", v1_ring.name(), v1_ring.bytes(), /*device_events=*/true);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument) << opened.status();
  EXPECT_TRUE(events.destroyed().empty());

  opened = rings.Open("", v2_ring.name(), v2_ring.bytes(), /*device_events=*/true);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->ready_event, "event-1");
  EXPECT_EQ(opened->done_event, "event-2");
  std::string response, message;
  events.CompleteAfter(3);  // the client's stream is still writing the inputs for 3 queries
  ASSERT_TRUE(v2_ring.RoundTrip(TinyDecodeFrame(ring::v2::kDeviceOrdered), &response, false));
  EXPECT_EQ(ResponseCode(response, &message), static_cast<int32_t>(absl::StatusCode::kUnavailable));
  EXPECT_EQ(events.queried(), std::vector<uintptr_t>(4, 1u));  // "ready", until it completed
  ASSERT_TRUE(v2_ring.RoundTrip(TinyDecodeFrame(0), &response, false));
  {
    const std::vector<FrameRecorder::Seen> seen = recorder.seen();
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_TRUE(seen[0].ordered);
    EXPECT_EQ(seen[0].done, reinterpret_cast<void*>(2));
    EXPECT_FALSE(seen[1].ordered);
    EXPECT_EQ(seen[1].done, nullptr);
  }
  // A "ready" that never completes (the client's GPU work stuck): DEADLINE_EXCEEDED after
  // ready_timeout, the handler never called, and the ring goes on.
  events.CompleteAfter(-1);
  ASSERT_TRUE(v2_ring.RoundTrip(TinyDecodeFrame(ring::v2::kDeviceOrdered), &response, false));
  EXPECT_EQ(ResponseCode(response, &message),
            static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(message, ::testing::HasSubstr("ready event did not complete within 50ms"));
  events.CompleteAfter(0);
  ASSERT_TRUE(v2_ring.RoundTrip(TinyDecodeFrame(ring::v2::kDeviceOrdered), &response, false));
  {
    const std::vector<FrameRecorder::Seen> seen = recorder.seen();
    EXPECT_EQ(seen.size(), 3u);
  }

  // A ring opened without events: the flag is refused before the handler.
  HandRing plain(64 * 1024);
  plain.header()->version = ring::v2::kVersion;
  absl::StatusOr<RingServer::Opened> plain_opened = rings.Open("", plain.name(), plain.bytes());
  ASSERT_TRUE(plain_opened.ok()) << plain_opened.status();
  EXPECT_TRUE(plain_opened->ready_event.empty());
  ASSERT_TRUE(plain.RoundTrip(TinyDecodeFrame(ring::v2::kDeviceOrdered), &response, false));
  EXPECT_EQ(ResponseCode(response, &message),
            static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(message, ::testing::HasSubstr("opened without device_events"));
  {
    const std::vector<FrameRecorder::Seen> seen = recorder.seen();
    EXPECT_EQ(seen.size(), 3u);
  }

  ASSERT_TRUE(rings.Close("", opened->ring_id).ok());
  EXPECT_THAT(events.destroyed(), ::testing::UnorderedElementsAre(1u, 2u));
  rings.Shutdown();
}

// With gates (a device with stream memory operations), a device-ordered decode does not wait on
// the host: the ring arms its gate with the client's "ready" event and the next value, and the
// handler gets the gate's word and that value for the engine's stream to wait on. A prefill still
// waits on the host. A client whose stream never reaches "ready": after ready_timeout the ring
// writes the word itself (no step waits any longer), closes, and retires the gate as stuck; the
// tenant's later rings get no gate.
TEST(RingDeviceEventsTest, DecodesWaitBehindAGateAttndOpensWhenTheClientIsStuck) {
  RegionRegistry registry(RegionRegistryOptions{}, nullptr, Clock::Real());
  RingOptions ring_options;
  ring_options.ready_timeout = absl::Milliseconds(50);
  RingServer rings(&registry, ring_options);
  FakeEvents events;
  events.EnableGates(41);  // a slot a closed ring left at 41
  rings.SetDeviceEvents(&events);
  FrameRecorder recorder(&rings, absl::OkStatus());
  HandRing r(64 * 1024);
  r.header()->version = ring::v2::kVersion;
  absl::StatusOr<RingServer::Opened> opened =
      rings.Open("", r.name(), r.bytes(), /*device_events=*/true);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::string response, message;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(r.RoundTrip(TinyDecodeFrame(ring::v2::kDeviceOrdered), &response, false));
    EXPECT_EQ(ResponseCode(response, &message), 0) << message;
  }
  std::string prefill = TinyDecodeFrame(ring::v2::kDeviceOrdered);
  reinterpret_cast<ring::v2::RequestHeader*>(prefill.data())->op = ring::v2::kPrefill;
  ASSERT_TRUE(r.RoundTrip(prefill, &response, false));
  EXPECT_TRUE(events.queried().size() >= 1u);  // the prefill's wait, on the host
  {
    const std::vector<FrameRecorder::Seen> seen = recorder.seen();
    ASSERT_EQ(seen.size(), 3u);
    EXPECT_EQ(seen[0].word, seen[1].word);
    EXPECT_NE(seen[0].word, nullptr);
    EXPECT_EQ(seen[0].value, 42u);
    EXPECT_EQ(seen[1].value, 43u);
    EXPECT_EQ(seen[2].op, ring::v2::kPrefill);
    EXPECT_EQ(seen[2].word, nullptr);
  }
  EXPECT_EQ(events.arms(), (std::vector<std::pair<uintptr_t, uint64_t>>{{1u, 42u}, {1u, 43u}}));
  EXPECT_EQ(events.word(), 43u);

  // The client's stream stops: the next decode is armed, answered (its step queued behind the
  // gate), and the word stays short of it until ready_timeout passes; then attnd writes it and
  // the ring is closed.
  events.SetClientStuck(true);
  ASSERT_TRUE(r.RoundTrip(TinyDecodeFrame(ring::v2::kDeviceOrdered), &response, false));
  EXPECT_EQ(ResponseCode(response, &message), 0) << message;
  EXPECT_EQ(events.word(), 43u);
  const absl::Time start = absl::Now();
  while (events.word() != 44u && absl::Now() - start < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(events.word(), 44u);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(30));
  // Broken: the idle sweep (any cutoff) reclaims it, and the gate goes back as stuck.
  while (!r.header()->closed.load() && absl::Now() - start < absl::Seconds(10)) {
    rings.ReclaimIdle();
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(r.header()->closed.load());
  EXPECT_EQ(events.destroyed_gates(), (std::vector<std::pair<int32_t, bool>>{{0, true}}));
  EXPECT_THAT(events.destroyed(), ::testing::UnorderedElementsAre(1u, 2u));

  // That tenant's next ring gets no gate: its decodes wait on the host, and cannot stall the
  // shared stream again.
  events.SetClientStuck(false);
  events.CompleteAfter(0);
  HandRing again(64 * 1024);
  again.header()->version = ring::v2::kVersion;
  opened = rings.Open("", again.name(), again.bytes(), /*device_events=*/true);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const size_t queries = events.queried().size();
  ASSERT_TRUE(again.RoundTrip(TinyDecodeFrame(ring::v2::kDeviceOrdered), &response, false));
  EXPECT_EQ(ResponseCode(response, &message), 0) << message;
  EXPECT_GT(events.queried().size(), queries);  // "ready", polled on the host
  EXPECT_EQ(events.arms().size(), 3u);          // no new arm
  {
    const std::vector<FrameRecorder::Seen> seen = recorder.seen();
    EXPECT_EQ(seen.back().word, nullptr);
  }
  rings.Shutdown();
}

// A frame with this tag (TinyDecodeFrame's, retagged).
std::string TaggedFrame(uint64_t tag) {
  std::string frame = TinyDecodeFrame(0);
  std::memcpy(frame.data() + offsetof(ring::v2::RequestHeader, tag), &tag, sizeof(tag));
  return frame;
}

uint64_t ResponseTag(const std::string& response) {
  ring::v2::ResponseHeader r{};
  std::memcpy(&r, response.data(), std::min(response.size(), sizeof(r)));
  return r.tag;
}

// Holds every frame's completion until the test releases it, in any order.
class HeldFrames {
 public:
  explicit HeldFrames(RingServer* rings) {
    rings->SetFrameHandler([this](const RequestFrame& frame, absl::string_view, FrameAnswer*,
                                  std::function<void(absl::Status)> done) {
      MutexLock lock(&mu_);
      held_[frame.tag] = std::move(done);
      return absl::OkStatus();
    });
  }
  bool WaitHeld(size_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      {
        MutexLock lock(&mu_);
        if (held_.size() >= n) return true;
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    return false;
  }
  // Answers the frame tagged `tag` with a code that names it (tag 3: NOT_FOUND, 5).
  void Release(uint64_t tag) {
    std::function<void(absl::Status)> done;
    {
      MutexLock lock(&mu_);
      done = std::move(held_[tag]);
      held_.erase(tag);
    }
    done(absl::Status(static_cast<absl::StatusCode>(tag + 2), absl::StrCat("frame ", tag)));
  }

 private:
  Mutex mu_;
  absl::flat_hash_map<uint64_t, std::function<void(absl::Status)>> held_ ABSL_GUARDED_BY(mu_);
};

// A ring of 4 slots takes 4 requests before any answer, each from its own slot; answers
// completed in reverse order are published in the order posted (response_seq never passes an
// unanswered request), each in its own slot's response half. A client that then posts more
// unanswered requests than the ring has slots has broken the protocol: the ring is closed and
// the extra requests never reach the handler.
TEST(RingSlotsTest, SeveralRequestsInFlightAreAnsweredInTheOrderPosted) {
  RegionRegistry registry(RegionRegistryOptions{}, nullptr, Clock::Real());
  RingOptions ring_options;
  ring_options.spin = absl::ZeroDuration();
  RingServer rings(&registry, ring_options);
  rings.SetHandler(
      [](const v1::SessionRequest&, absl::string_view, v1::SessionResponse*,
         std::function<void(absl::Status)>) { return absl::UnimplementedError("version 1"); });
  HeldFrames held(&rings);
  HandRing hand(16 * 1024, "/attnd-", 4);
  absl::StatusOr<RingServer::Opened> opened = rings.Open("", hand.name(), hand.bytes());
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->request_capacity, 16 * 1024 - 8u);
  ring::Header* h = hand.header();
  for (uint32_t seq = 1; seq <= 4; ++seq) hand.Post(seq, TaggedFrame(seq));
  ASSERT_TRUE(held.WaitHeld(4));
  for (uint64_t tag : {4, 3, 2}) {
    held.Release(tag);
    EXPECT_EQ(h->response_seq.load(), 0u) << "published past unanswered request 1";
  }
  held.Release(1);
  EXPECT_EQ(h->response_seq.load(), 4u);
  for (uint32_t seq = 1; seq <= 4; ++seq) {
    std::string message;
    const std::string response = hand.Response(seq);
    EXPECT_EQ(ResponseTag(response), seq);
    EXPECT_EQ(ResponseCode(response, &message), static_cast<int32_t>(seq + 2));
    EXPECT_EQ(message, absl::StrCat("frame ", seq));
  }
  // Slot 1 again (request 5), while the others stay free.
  hand.Post(5, TaggedFrame(5));
  ASSERT_TRUE(held.WaitHeld(1));
  held.Release(5);
  EXPECT_EQ(h->response_seq.load(), 5u);
  EXPECT_EQ(ResponseTag(hand.Response(5)), 5u);

  // 5 unanswered on 4 slots (request_seq jumps from 5 to 10): closed, and none of them reaches
  // the handler.
  for (uint32_t seq = 6; seq <= 10; ++seq) hand.Write(seq, TaggedFrame(seq));
  hand.Publish(10);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (rings.ReclaimIdle() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(hand.WaitClosed(absl::Seconds(1)));
  EXPECT_EQ(rings.open_rings(), 0);
  EXPECT_FALSE(held.WaitHeld(1)) << "a request of the overrun reached the handler";
  rings.Shutdown();
}

// What a ring's header may say about slots, judged at OpenRing with messages that say what is
// allowed: slots other than a power of two up to kMaxSlots, several slots on a version 1 ring or
// with device events, and an object whose size does not match its slots and halves.
TEST(RingSlotsTest, BadSlotsAreRefusedAtOpenRing) {
  RegionRegistry registry(RegionRegistryOptions{}, nullptr, Clock::Real());
  RingServer rings(&registry, RingOptions{});
  FakeEvents events;
  rings.SetDeviceEvents(&events);
  HeldFrames held(&rings);
  rings.SetHandler(
      [](const v1::SessionRequest&, absl::string_view, v1::SessionResponse*,
         std::function<void(absl::Status)>) { return absl::UnimplementedError("version 1"); });
  struct Case {
    uint32_t slots;
    uint32_t version;
    bool device_events;
    uint64_t half_bytes;  // what the header says; the object holds 4 halves of 8192
    std::string message;
  };
  const std::vector<Case> cases = {
      {3, 2, false, 8192,
       "says slots 3; a ring holds 0 or 1 (one request at a time) or a power of two up to 16"},
      {32, 2, false, 8192, "says slots 32"},
      {2, 1, false, 8192, "a ring of 2 slots needs version 2 frames; this one is version 1"},
      {2, 2, true, 8192, "a device-ordered ring holds one request at a time"},
      {4, 2, false, 7168,
       "says half_bytes 7168 and slots 4, so byte_size must be 4096 + 8 * half_bytes; it is "
       "69632"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    HandRing hand(8192, "/attnd-", 4);
    hand.header()->slots = c.slots;
    hand.header()->version = c.version;
    hand.header()->half_bytes = c.half_bytes;
    absl::StatusOr<RingServer::Opened> opened =
        rings.Open("", hand.name(), hand.bytes(), c.device_events);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument) << opened.status();
    EXPECT_THAT(std::string(opened.status().message()), ::testing::HasSubstr(c.message));
    EXPECT_EQ(rings.open_rings(), 0);
  }
  EXPECT_TRUE(events.destroyed().empty());
  rings.Shutdown();
}

}  // namespace
}  // namespace attnd
