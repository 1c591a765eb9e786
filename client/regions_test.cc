// ShmBuffer, the ring's layout and RingClient's side of the protocol, against a fake server thread
// that plays attnd's side over its own mapping of the same shm object (no daemon needed).
#include "client/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace client {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

TEST(ShmBuffer, CreatesMapsAndUnlinks) {
  std::string name;
  {
    absl::StatusOr<std::unique_ptr<ShmBuffer>> buf = ShmBuffer::Create(10000);
    ASSERT_TRUE(buf.ok()) << buf.status();
    name = (*buf)->name();
    EXPECT_THAT(name, MatchesRegex("/attnd-[0-9a-f]{32}"));
    EXPECT_EQ((*buf)->size(), 10000u);
    for (size_t i = 0; i < 10000; ++i) ASSERT_EQ((*buf)->data()[i], 0);
    std::memset((*buf)->data(), 0xab, 10000);
    // Another mapping of the name sees the bytes (what attnd does).
    int fd = shm_open(name.c_str(), O_RDONLY, 0);
    ASSERT_GE(fd, 0);
    struct stat st;
    ASSERT_EQ(fstat(fd, &st), 0);
    EXPECT_EQ(st.st_size, 10000);
    void* p = mmap(nullptr, 10000, PROT_READ, MAP_SHARED, fd, 0);
    ASSERT_NE(p, MAP_FAILED);
    EXPECT_EQ(static_cast<uint8_t*>(p)[9999], 0xab);
    munmap(p, 10000);
    close(fd);
  }
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);
  EXPECT_EQ(errno, ENOENT);
}

TEST(ShmBuffer, NamesAreFreshAndZeroBytesIsRefused) {
  auto a = ShmBuffer::Create(4096);
  auto b = ShmBuffer::Create(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->name(), (*b)->name());
  EXPECT_EQ(ShmBuffer::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RingLayout, HeaderAsShmRingHSays) {
  RingOptions options;
  options.half_bytes = 64 << 10;
  options.version = 1;
  auto ring = RingClient::CreateUnopened(options);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const ShmBuffer& buf = (*ring)->buffer();
  EXPECT_EQ(buf.size(), ring::kHeaderBytes + 2 * (64u << 10));
  uint64_t magic;
  uint32_t version;
  uint64_t half;
  std::memcpy(&magic, buf.data(), 8);
  std::memcpy(&version, buf.data() + 8, 4);
  std::memcpy(&half, buf.data() + 16, 8);
  EXPECT_EQ(magic, 0x31474e52444e5441ull);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buf.data()), 8), "ATNDRNG1");
  EXPECT_EQ(version, 1u);
  EXPECT_EQ(half, 64u << 10);
  for (size_t off : {64, 128, 192, 256, 320}) {
    uint32_t word;
    std::memcpy(&word, buf.data() + off, 4);
    EXPECT_EQ(word, 0u) << off;
  }
  EXPECT_EQ((*ring)->capacity(), (64u << 10) - 8);
  EXPECT_TRUE((*ring)->ring_id().empty());
}

TEST(RingLayout, VersionTwoByDefault) {
  auto ring = RingClient::CreateUnopened();
  ASSERT_TRUE(ring.ok()) << ring.status();
  uint32_t version;
  std::memcpy(&version, (*ring)->buffer().data() + 8, 4);
  EXPECT_EQ(version, 2u);
  // SessionRequests are a version 1 ring's.
  EXPECT_EQ((*ring)->RoundTrip(v1::SessionRequest()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(RingLayout, HalfBytesMustBePages) {
  RingOptions options;
  options.half_bytes = 1000;
  EXPECT_EQ(RingClient::CreateUnopened(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// attnd's side of the protocol over a second mapping of the ring.
class FakeServer {
 public:
  explicit FakeServer(const ShmBuffer& buf) : size_(buf.size()) {
    int fd = shm_open(buf.name().c_str(), O_RDWR, 0);
    EXPECT_GE(fd, 0);
    base_ = static_cast<uint8_t*>(mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    h_ = reinterpret_cast<ring::Header*>(base_);
    half_ = h_->half_bytes;
  }
  ~FakeServer() {
    Stop();
    munmap(base_, size_);
  }

  void Start() {
    last_ = h_->response_seq.load();
    thread_ = std::thread([this] { Loop(); });
  }
  void Stop() {
    if (!thread_.joinable()) return;
    stop_ = true;
    ring::FutexWake(&h_->request_seq);
    thread_.join();
  }

  std::atomic<int64_t> spin_us{1000000};  // how long to spin before sleeping
  std::atomic<int64_t> delay_us{0};       // before answering
  std::atomic<bool> paused{false};        // do not answer while set
  std::atomic<bool> close_next{false};    // set `closed` instead of answering
  std::atomic<int> served{0};
  std::atomic<int> slept{0};        // times the server went to sleep on request_seq
  std::atomic<int> woke_client{0};  // FutexWake calls on response_seq
  ring::Header* h_;

 private:
  void Loop() {
    while (!stop_) {
      // Wait for request_seq to move: spin, then sleep.
      const absl::Time spin_end = absl::Now() + absl::Microseconds(spin_us.load());
      while (!stop_ && h_->request_seq.load(std::memory_order_acquire) == last_ &&
             absl::Now() < spin_end) {
      }
      if (!stop_ && h_->request_seq.load(std::memory_order_acquire) == last_) {
        h_->server_sleeping.store(1, std::memory_order_seq_cst);
        ++slept;
        while (!stop_ && h_->request_seq.load(std::memory_order_seq_cst) == last_) {
          ring::FutexWait(&h_->request_seq, last_, 20000);
        }
        h_->server_sleeping.store(0, std::memory_order_relaxed);
      }
      if (stop_) break;
      while (paused && !stop_) absl::SleepFor(absl::Milliseconds(1));
      const uint32_t seq = h_->request_seq.load(std::memory_order_acquire);
      uint64_t len;
      std::memcpy(&len, base_ + ring::RequestOffset(), 8);
      v1::SessionRequest req;
      v1::SessionResponse resp;
      if (len > ring::Capacity(half_) ||
          !req.ParseFromArray(base_ + ring::RequestOffset() + 8, static_cast<int>(len))) {
        resp.set_code(3);
        resp.set_message("malformed");
      } else {
        resp.set_tag(req.tag());
        if (req.has_decode()) {
          for (const v1::DecodeEntry& e : req.decode().entries()) {
            v1::DecodeOutput* o = resp.mutable_decode()->add_outputs();
            if (e.has_output_region()) {
              o->mutable_o()->set_dtype(e.v().dtype());
              o->mutable_o()->add_shape(1);
              *o->mutable_o()->mutable_region() = e.output_region();
            } else {
              *o->mutable_o() = e.v();  // echo v as the output
            }
            o->set_length(static_cast<int64_t>(seq));
          }
        } else if (req.has_prefill()) {
          if (req.prefill().sequence_id() == "bad") {
            resp.set_code(5);
            resp.set_message("unknown sequence");
          } else {
            *resp.mutable_prefill()->mutable_o() = req.prefill().v();
            resp.mutable_prefill()->set_length(42);
          }
        }
      }
      if (delay_us > 0) absl::SleepFor(absl::Microseconds(delay_us.load()));
      last_ = seq;
      if (close_next) {
        h_->closed.store(1, std::memory_order_seq_cst);
        ring::FutexWake(&h_->response_seq);
        ring::FutexWake(&h_->request_seq);
        continue;
      }
      const uint64_t out_len = resp.ByteSizeLong();
      uint8_t* out = base_ + ring::ResponseOffset(half_);
      std::memcpy(out, &out_len, 8);
      resp.SerializeToArray(out + 8, static_cast<int>(out_len));
      h_->response_seq.store(seq, std::memory_order_seq_cst);
      ++served;
      if (h_->client_sleeping.load(std::memory_order_seq_cst) != 0) {
        ring::FutexWake(&h_->response_seq);
        ++woke_client;
      }
    }
  }

  size_t size_;
  uint8_t* base_;
  uint64_t half_;
  uint32_t last_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

DecodeInput Entry(const std::string& id, float value) {
  DecodeInput in;
  in.sequence_id = id;
  in.q = HostTensor::FromFloats(DType::kFp32, {3, 2, 4}, std::vector<float>(24, value));
  in.k = HostTensor::FromFloats(DType::kFp32, {1, 4}, std::vector<float>(4, value));
  in.v = HostTensor::FromFloats(DType::kFp32, {1, 4}, std::vector<float>(4, value + 1));
  return in;
}

// The fake server speaks version 1 (SessionRequest / SessionResponse).
std::unique_ptr<RingClient> MakeRing(RingOptions options = {}) {
  options.half_bytes = 64 << 10;
  options.version = 1;
  auto ring = RingClient::CreateUnopened(options);
  EXPECT_TRUE(ring.ok()) << ring.status();
  return std::move(*ring);
}

TEST(RingClient, RoundTripsWhileSpinning) {
  RingOptions options;
  options.spin = absl::Seconds(5);  // the answer always comes within the spin
  auto ring = MakeRing(options);
  FakeServer server(ring->buffer());
  server.Start();
  for (int i = 0; i < 200; ++i) {
    absl::StatusOr<std::vector<DecodeResult>> r =
        ring->Decode(3, {Entry("a", static_cast<float>(i)), Entry("b", 1)});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->size(), 2u);
    EXPECT_EQ((*r)[0].o.ToFloats()[0], static_cast<float>(i + 1));
    EXPECT_EQ((*r)[0].length, i + 1);  // the fake server answers the sequence number
  }
  EXPECT_EQ(ring->stats().round_trips, 200);
  EXPECT_EQ(ring->stats().answered_spinning, 200);
  EXPECT_EQ(ring->stats().answered_sleeping, 0);
  EXPECT_EQ(ring->header()->request_seq.load(), 200u);
  EXPECT_EQ(ring->header()->response_seq.load(), 200u);
  EXPECT_EQ(ring->header()->client_sleeping.load(), 0u);
}

TEST(RingClient, SleepsAndIsWoken) {
  RingOptions options;
  options.spin = absl::ZeroDuration();
  auto ring = MakeRing(options);
  FakeServer server(ring->buffer());
  server.delay_us = 20000;  // the client is asleep by the time the answer comes
  server.Start();
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < 5; ++i) {
    auto r = ring->Decode(0, {Entry("a", 1)});
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(ring->stats().answered_sleeping, 5);
  EXPECT_EQ(server.woke_client.load(), 5);
  // Woken by the futex, not by the 10 ms sleep slices running out (well under 5 * (20 + 10) ms).
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(5 * 28));
  EXPECT_EQ(ring->header()->client_sleeping.load(), 0u);
}

TEST(RingClient, WakesASleepingServer) {
  auto ring = MakeRing();
  FakeServer server(ring->buffer());
  server.spin_us = 0;  // the server sleeps on request_seq at once
  server.Start();
  for (int i = 0; i < 5; ++i) {
    // Give the server time to fall asleep.
    absl::Time until = absl::Now() + absl::Milliseconds(50);
    while (ring->header()->server_sleeping.load() == 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(ring->header()->server_sleeping.load(), 1u);
    const absl::Time t0 = absl::Now();
    auto r = ring->Decode(0, {Entry("a", 1)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LT(absl::Now() - t0, absl::Milliseconds(15));  // woken, not the server's 20 ms timeout
  }
  EXPECT_EQ(ring->stats().server_wakes, 5);
}

TEST(RingClient, ClosedIsUnavailable) {
  RingOptions options;
  options.spin = absl::Microseconds(10);
  options.timeout = absl::Seconds(30);
  auto ring = MakeRing(options);
  FakeServer server(ring->buffer());
  server.close_next = true;
  server.Start();
  const absl::Time t0 = absl::Now();
  auto r = ring->Decode(0, {Entry("a", 1)});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // Later calls fail at once.
  EXPECT_EQ(ring->Decode(0, {Entry("a", 1)}).status().code(), absl::StatusCode::kUnavailable);
}

TEST(RingClient, ClosedWhileSpinningIsUnavailable) {
  RingOptions options;
  options.spin = absl::Seconds(5);
  auto ring = MakeRing(options);
  FakeServer server(ring->buffer());
  server.close_next = true;
  server.Start();
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(ring->Decode(0, {Entry("a", 1)}).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
}

TEST(RingClient, TimeoutThenTheLateAnswerIsSkipped) {
  RingOptions options;
  options.spin = absl::Microseconds(10);
  options.timeout = absl::Milliseconds(100);
  auto ring = MakeRing(options);
  FakeServer server(ring->buffer());
  server.paused = true;
  server.Start();
  const absl::Time t0 = absl::Now();
  auto r = ring->Decode(0, {Entry("a", 1)});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(100));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  // Still unanswered: the next call waits for the ring to be free and times out too.
  EXPECT_EQ(ring->Decode(0, {Entry("a", 1)}).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ring->header()->request_seq.load(), 1u);  // nothing new was written
  server.paused = false;
  // The late answer to request 1 is not mistaken for request 2's.
  auto ok = ring->Decode(0, {Entry("a", 7)});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)[0].length, 2);
  EXPECT_EQ((*ok)[0].o.ToFloats()[0], 8.f);
}

TEST(RingClient, SequenceWordsWrap) {
  auto ring = MakeRing();
  ring->header()->request_seq.store(0xfffffffeu);
  ring->header()->response_seq.store(0xfffffffeu);
  FakeServer server(ring->buffer());
  server.Start();
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(ring->Decode(0, {Entry("a", 1)}).ok());
  EXPECT_EQ(ring->header()->request_seq.load(), 2u);
}

TEST(RingClient, TooLargeAndErrorsAndPrefill) {
  auto ring = MakeRing();
  FakeServer server(ring->buffer());
  server.Start();
  DecodeInput big = Entry("a", 1);
  big.v = HostTensor::FromFloats(DType::kFp32, {1, 1 << 15}, std::vector<float>(1 << 15, 1));
  EXPECT_EQ(ring->Decode(0, {big}).status().code(), absl::StatusCode::kResourceExhausted);
  HostTensor q = HostTensor::FromFloats(DType::kFp32, {1, 5, 2, 4}, std::vector<float>(40, 1));
  HostTensor kv = HostTensor::FromFloats(DType::kFp32, {1, 1, 4}, std::vector<float>(4, 2));
  auto bad = ring->Prefill("bad", 0, q, kv, kv);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(bad.status().message(), HasSubstr("unknown sequence"));
  auto good = ring->Prefill("seq", 0, q, kv, kv, 1);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->length, 42);
  EXPECT_EQ(good->o.ToFloats(), std::vector<float>(4, 2));
}

TEST(RingClient, RegionRefsAndOutputRegions) {
  auto ring = MakeRing();
  FakeServer server(ring->buffer());
  server.Start();
  DecodeInput in = Entry("a", 1);
  in.q_ref = TensorRef::In("0123456789abcdef0123456789abcdef", 4096, DType::kBf16, {3, 2, 4});
  v1::RegionRef out;
  out.set_region_id("0123456789abcdef0123456789abcdef");
  out.set_offset(8192);
  out.set_byte_size(16);
  in.output_region = out;
  auto r = ring->Decode(0, {in});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)[0].o_region.has_value());
  EXPECT_EQ((*r)[0].o_region->offset(), 8192u);
  EXPECT_TRUE((*r)[0].o.data.empty());
}

TEST(RequestBuilding, RegionRefsReplaceBytes) {
  DecodeInput in = Entry("a", 1);
  in.k_ref = TensorRef::In("id", 64, DType::kBf16, {1, 4});
  v1::DecodeRequest req;
  internal::BuildDecode(2, {in}, &req);
  const v1::DecodeEntry& e = req.entries(0);
  EXPECT_FALSE(e.q().data().empty());
  EXPECT_TRUE(e.k().data().empty());
  EXPECT_EQ(e.k().region().region_id(), "id");
  EXPECT_EQ(e.k().region().offset(), 64u);
  EXPECT_EQ(e.k().region().byte_size(), 8u);
  EXPECT_EQ(e.k().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(e.k().shape_size(), 2);
  EXPECT_FALSE(e.has_output_region());

  HostTensor q = HostTensor::FromFloats(DType::kFp32, {1, 5, 2, 4}, std::vector<float>(40, 1));
  PrefillInput p;
  p.sequence_id = "s";
  p.q = q;
  p.k = TensorRef::In("id", 0, DType::kFp32, {1, 1, 4});
  p.v = TensorRef::In("id", 16, DType::kFp32, {1, 1, 4});
  v1::RegionRef out;
  out.set_region_id("id");
  out.set_offset(32);
  out.set_byte_size(32);
  p.output_region = out;
  v1::PrefillRequest pr;
  internal::BuildPrefill(p, &pr);
  EXPECT_EQ(pr.q().data().size(), 160u);
  EXPECT_EQ(pr.v().region().offset(), 16u);
  EXPECT_EQ(pr.output_region().offset(), 32u);

  v1::PrefillResponse resp;
  resp.mutable_o()->set_dtype(v1::DTYPE_FP32);
  resp.mutable_o()->add_shape(1);
  resp.mutable_o()->add_shape(2);
  resp.mutable_o()->add_shape(4);
  *resp.mutable_o()->mutable_region() = out;
  resp.set_length(1);
  auto parsed = internal::ParsePrefill(resp);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->o.shape, (std::vector<int64_t>{1, 2, 4}));
  EXPECT_TRUE(parsed->o.data.empty());
  ASSERT_TRUE(parsed->o_region.has_value());
  EXPECT_EQ(parsed->o_region->offset(), 32u);
  resp.mutable_o()->set_data("x");
  EXPECT_EQ(internal::ParsePrefill(resp).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace client
}  // namespace attnd
