// Ring v2 (proto/attnd/v1/ring_frame.h) against a Session stream on the same CPU daemon: every
// class of bad input the Session refuses is refused through the ring with the same code and the
// same message, and changes nothing (no sequence advances, no page is taken); good requests give
// the Session's bytes, with tensors inline or in a registered shm region; OpenRing refuses a
// version it does not serve, naming the ones it does.
#include <sys/mman.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "client/attnd_client.h"
#include "client/regions.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

// Built with ThreadSanitizer or AddressSanitizer: timing-based claims do not hold there.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

using client::DecodeInput;
using client::HostTensor;
using client::PrefillInput;
using client::RingClient;
using ::testing::HasSubstr;

// A Session stream: one request, its answer as a status.
class SessionStream {
 public:
  explicit SessionStream(v1::Attention::Stub* stub) : stream_(stub->Session(&context_)) {}
  ~SessionStream() {
    if (finished_) return;
    stream_->WritesDone();
    stream_->Finish().IgnoreError();
  }
  absl::StatusOr<v1::SessionResponse> Send(const v1::SessionRequest& request) {
    if (!stream_->Write(request)) return absl::UnavailableError("the Session stream broke");
    v1::SessionResponse response;
    if (!stream_->Read(&response)) {  // the stream ended: its status says why
      const grpc::Status s = stream_->Finish();
      finished_ = true;
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    }
    if (response.code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
    }
    return response;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  bool finished_ = false;
};

// The packed DecodeRequest of `entries` (each tensor's rows concatenated), built here from the
// form attention.proto documents, not by the ring's client.
v1::SessionRequest PackedDecode(int32_t layer, const std::vector<DecodeInput>& entries) {
  v1::SessionRequest r;
  v1::DecodeRequest* d = r.mutable_decode();
  d->set_layer(layer);
  d->set_q_layout(entries[0].q_layout);
  for (const DecodeInput& e : entries) d->add_sequence_ids(e.sequence_id);
  for (auto [get, out] : {std::make_pair(&DecodeInput::q, d->mutable_q()),
                          std::make_pair(&DecodeInput::k, d->mutable_k()),
                          std::make_pair(&DecodeInput::v, d->mutable_v())}) {
    const HostTensor& first = entries[0].*get;
    out->set_dtype(client::ToProtoDType(first.dtype));
    out->add_shape(static_cast<int64_t>(entries.size()));
    for (int64_t dim : first.shape) out->add_shape(dim);
    for (const DecodeInput& e : entries) out->mutable_data()->append((e.*get).data);
  }
  return r;
}

class RingV2Test : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options = testing::SmallCpuOptions();
    options.ring_spin = absl::Microseconds(20);
    options.max_message_bytes = 1 << 20;
    absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
        testing::TestDaemon::Start(geometry_, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    stub_ = v1::Attention::NewStub(
        grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
    client::RingOptions ring_options;  // version 2: the default
    ring_options.half_bytes = 2 << 20;
    absl::StatusOr<std::unique_ptr<RingClient>> ring = RingClient::Open(c(), ring_options);
    ASSERT_TRUE(ring.ok()) << ring.status();
    ring_ = std::move(*ring);
    session_ = std::make_unique<SessionStream>(stub_.get());
  }
  void TearDown() override {
    session_.reset();
    ring_.reset();
  }

  client::AttndClient& c() { return daemon_->client(); }
  std::string NewSeq() {
    absl::StatusOr<std::string> id = c().CreateSequence();
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }
  HostTensor Random(std::vector<int64_t> shape, DType dtype = DType::kFp32) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return HostTensor::FromFloats(dtype, std::move(shape), testing::RandomInputs(&rng_, n));
  }
  DecodeInput Entry(const std::string& id) {
    const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
    return DecodeInput{id, Random({3, hq, d}), Random({hkv, d}), Random({hkv, d})};
  }
  PrefillInput Prefill(const std::string& id, int64_t t) {
    const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
    prefill_q_ = Random({t, 5, hq, d});
    prefill_k_ = Random({t, hkv, d});
    prefill_v_ = Random({t, hkv, d});
    PrefillInput in;
    in.sequence_id = id;
    in.layer = 1;
    in.q = prefill_q_;
    in.k = prefill_k_;
    in.v = prefill_v_;
    return in;
  }
  v1::SessionRequest SessionPrefill(const PrefillInput& in) {
    v1::SessionRequest r;
    client::internal::BuildPrefill(in, r.mutable_prefill());
    return r;
  }
  // What the daemon holds: a bad request must change none of it.
  std::pair<int64_t, int64_t> Held() {
    absl::StatusOr<v1::GetServerInfoResponse> info = c().Info();
    EXPECT_TRUE(info.ok()) << info.status();
    return {info->live_sequences(), info->kv_cache().pages_free()};
  }

  testing::ModelGeometry geometry_;
  std::mt19937 rng_{11};
  std::unique_ptr<testing::TestDaemon> daemon_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  std::unique_ptr<RingClient> ring_;
  std::unique_ptr<SessionStream> session_;
  HostTensor prefill_q_, prefill_k_, prefill_v_;
};

TEST_F(RingV2Test, GoodRequestsGiveTheSessionsBytes) {
  const std::string a = NewSeq(), b = NewSeq(), ta = NewSeq(), tb = NewSeq();
  for (const auto& [ring_id, twin] : {std::make_pair(a, ta), std::make_pair(b, tb)}) {
    PrefillInput in = Prefill(ring_id, 21);
    in.prompt_len = 40;
    absl::StatusOr<client::PrefillResult> got = ring_->Prefill(in);
    in.sequence_id = twin;
    absl::StatusOr<v1::SessionResponse> want = session_->Send(SessionPrefill(in));
    ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
    EXPECT_EQ(got->length, 21);
    EXPECT_EQ(got->o.shape, (std::vector<int64_t>{21, geometry_.num_q_heads, geometry_.head_dim}));
    EXPECT_TRUE(got->o.data == want->prefill().o().data());
  }
  for (int step = 0; step < 5; ++step) {
    std::vector<DecodeInput> entries = {Entry(a), Entry(b)};
    std::vector<DecodeInput> twins = entries;
    twins[0].sequence_id = ta;
    twins[1].sequence_id = tb;
    absl::StatusOr<std::vector<client::DecodeResult>> got = ring_->Decode(1, entries);
    absl::StatusOr<v1::SessionResponse> want = session_->Send(PackedDecode(1, twins));
    ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
    ASSERT_EQ(got->size(), 2u);
    const std::string& o = want->decode().o().data();
    const size_t row = o.size() / 2;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ((*got)[i].length, 22 + step);
      EXPECT_EQ((*got)[i].length, want->decode().lengths(static_cast<int>(i)));
      EXPECT_EQ((*got)[i].o.shape,
                (std::vector<int64_t>{geometry_.num_q_heads, geometry_.head_dim}));
      EXPECT_TRUE((*got)[i].o.data == o.substr(i * row, row)) << step << " " << i;
    }
  }
}

TEST_F(RingV2Test, TensorsInARegionGiveTheInlineBytes) {
  auto buf = client::ShmBuffer::Create(1 << 20);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto region = client::RegisteredRegion::Shm(c(), **buf);
  ASSERT_TRUE(region.ok()) << region.status();
  uint8_t* mem = (*buf)->data();
  const int64_t hq = geometry_.num_q_heads, d = geometry_.head_dim;
  const std::string a = NewSeq(), b = NewSeq(), twin = NewSeq();
  // Prefill: q, k and v in the region, o into it.
  PrefillInput in = Prefill(a, 9);
  std::memcpy(mem, prefill_q_.data.data(), prefill_q_.data.size());
  std::memcpy(mem + 65536, prefill_k_.data.data(), prefill_k_.data.size());
  std::memcpy(mem + 131072, prefill_v_.data.data(), prefill_v_.data.size());
  in.q = region->Tensor(0, DType::kFp32, prefill_q_.shape);
  in.k = region->Tensor(65536, DType::kFp32, prefill_k_.shape);
  in.v = region->Tensor(131072, DType::kFp32, prefill_v_.shape);
  const uint64_t o_bytes = 9 * hq * d * 4;
  in.output_region = region->Ref(262144, o_bytes);
  absl::StatusOr<client::PrefillResult> got = ring_->Prefill(in);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->o_region.has_value());
  EXPECT_TRUE(got->o.data.empty());
  // The twin gets the region's values inline (Prefill draws new ones: only the shapes are kept).
  PrefillInput inline_in = Prefill(b, 9);
  HostTensor q(prefill_q_);
  q.data.assign(reinterpret_cast<const char*>(mem), prefill_q_.data.size());
  HostTensor k(prefill_k_), v(prefill_v_);
  k.data.assign(reinterpret_cast<const char*>(mem + 65536), prefill_k_.data.size());
  v.data.assign(reinterpret_cast<const char*>(mem + 131072), prefill_v_.data.size());
  inline_in.q = q;
  inline_in.k = k;
  inline_in.v = v;
  inline_in.sequence_id = twin;
  absl::StatusOr<v1::SessionResponse> want = session_->Send(SessionPrefill(inline_in));
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(std::string(reinterpret_cast<const char*>(mem + 262144), o_bytes) ==
              want->prefill().o().data());
  // Decode: q, k and v in the region, o into it.
  DecodeInput e = Entry(a);
  const uint64_t q_row = e.q.data.size(), kv_row = e.k.data.size(), o_row = hq * d * 4;
  std::memcpy(mem + 400000, e.q.data.data(), q_row);
  std::memcpy(mem + 500000, e.k.data.data(), kv_row);
  std::memcpy(mem + 600000, e.v.data.data(), kv_row);
  DecodeInput r;
  r.sequence_id = a;
  r.q_ref = region->Tensor(400000, DType::kFp32, e.q.shape);
  r.k_ref = region->Tensor(500000, DType::kFp32, e.k.shape);
  r.v_ref = region->Tensor(600000, DType::kFp32, e.v.shape);
  r.output_region = region->Ref(700000, o_row);
  absl::StatusOr<std::vector<client::DecodeResult>> gd = ring_->Decode(1, {r});
  ASSERT_TRUE(gd.ok()) << gd.status();
  e.sequence_id = twin;
  absl::StatusOr<v1::SessionResponse> wd = session_->Send(PackedDecode(1, {e}));
  ASSERT_TRUE(wd.ok()) << wd.status();
  EXPECT_EQ((*gd)[0].length, 10);
  EXPECT_TRUE(std::string(reinterpret_cast<const char*>(mem + 700000), o_row) ==
              wd->decode().o().data());
  // References that are not back to back are refused before anything is sent.
  DecodeInput r2 = r;
  r2.sequence_id = b;
  r2.q_ref = region->Tensor(400000 + q_row + 64, DType::kFp32, e.q.shape);
  absl::StatusOr<std::vector<client::DecodeResult>> apart = ring_->Decode(1, {r, r2});
  EXPECT_EQ(apart.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(apart.status().message(), HasSubstr("back to back in one region"));
  EXPECT_EQ(ring_->stats().round_trips, 2);
}

// Each class of bad input: the Session's code and message, and nothing changed.
TEST_F(RingV2Test, BadInputGetsTheSessionsAnswerAndChangesNothing) {
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const std::string a = NewSeq(), b = NewSeq();
  ASSERT_TRUE(ring_->Prefill(Prefill(a, 16)).ok());
  ASSERT_TRUE(ring_->Prefill(Prefill(b, 16)).ok());
  auto buf = client::ShmBuffer::Create(1 << 20);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto region = client::RegisteredRegion::Shm(c(), **buf);
  ASSERT_TRUE(region.ok()) << region.status();
  const std::pair<int64_t, int64_t> before = Held();

  struct DecodeCase {
    std::string what;
    int32_t layer;
    std::vector<DecodeInput> entries;
  };
  std::vector<DecodeCase> decodes;
  decodes.push_back({"wrong layer", 7, {Entry(a)}});
  decodes.push_back({"malformed id", 1, {Entry("not-a-sequence-id")}});
  decodes.push_back({"unknown sequence", 1, {Entry("0123456789abcdef0123456789abcdef")}});
  decodes.push_back({"duplicate sequence", 1, {Entry(a), Entry(a)}});
  {
    DecodeCase k_heads{"wrong k head count", 1, {Entry(a)}};
    k_heads.entries[0].k = Random({hkv + 1, d});
    decodes.push_back(k_heads);
    DecodeCase q_heads{"wrong q head count", 1, {Entry(a), Entry(b)}};
    for (DecodeInput& e : q_heads.entries) e.q = Random({3, hq + 1, d});
    decodes.push_back(q_heads);
    DecodeCase dtype{"mixed dtypes", 1, {Entry(a)}};
    dtype.entries[0].v = Random({hkv, d}, DType::kBf16);
    decodes.push_back(dtype);
    DecodeCase bad_dtype{"unknown dtype", 1, {Entry(a)}};
    bad_dtype.entries[0].k.dtype = static_cast<DType>(9);
    decodes.push_back(bad_dtype);
    DecodeCase layout{"unknown q_layout", 1, {Entry(a)}};
    layout.entries[0].q_layout = static_cast<v1::QLayout>(5);
    decodes.push_back(layout);
    DecodeCase bytes{"data short of its shape", 1, {Entry(a)}};
    bytes.entries[0].v.data.resize(bytes.entries[0].v.data.size() - 4);
    decodes.push_back(bytes);
    DecodeCase nan{"NaN in q", 1, {Entry(a)}};
    std::vector<float> values = nan.entries[0].q.ToFloats();
    values[5] = std::nanf("");
    nan.entries[0].q = HostTensor::FromFloats(DType::kFp32, nan.entries[0].q.shape, values);
    decodes.push_back(nan);
  }
  for (const DecodeCase& c : decodes) {
    const absl::Status want = session_->Send(PackedDecode(c.layer, c.entries)).status();
    const absl::Status got = ring_->Decode(c.layer, c.entries).status();
    EXPECT_FALSE(want.ok()) << c.what;
    EXPECT_EQ(got.code(), want.code()) << c.what << ": " << got;
    EXPECT_EQ(got.message(), want.message()) << c.what;
    EXPECT_EQ(Held(), before) << c.what;
  }

  struct PrefillCase {
    std::string what;
    PrefillInput in;
  };
  std::vector<PrefillCase> prefills;
  auto add = [&](const std::string& what, auto mutate) {
    PrefillCase p{what, Prefill(a, 8)};
    mutate(&p.in);
    prefills.push_back(std::move(p));
  };
  // The tensors the mutations below point at live as long as the cases.
  std::vector<std::unique_ptr<HostTensor>> keep;
  auto own = [&](HostTensor t) {
    keep.push_back(std::make_unique<HostTensor>(std::move(t)));
    return client::TensorArg(*keep.back());
  };
  add("wrong layer", [](PrefillInput* in) { in->layer = 2; });
  add("malformed id", [](PrefillInput* in) { in->sequence_id = "x"; });
  add("unknown sequence",
      [](PrefillInput* in) { in->sequence_id = "0123456789abcdef0123456789abcdef"; });
  add("prompt_len too small", [](PrefillInput* in) { in->prompt_len = 3; });
  add("wrong k head count", [&](PrefillInput* in) { in->k = own(Random({8, hkv + 1, d})); });
  add("wrong dtype", [&](PrefillInput* in) { in->v = own(Random({8, hkv, d}, DType::kBf16)); });
  add("q of the wrong rank", [&](PrefillInput* in) { in->q = own(Random({8, hq, d})); });
  add("unknown region", [&](PrefillInput* in) {
    in->k = client::TensorRef::In(std::string(32, 'e'), 0, DType::kFp32, {8, hkv, d});
  });
  add("reference past the region", [&](PrefillInput* in) {
    in->k = region->Tensor((1 << 20) - 64, DType::kFp32, {8, hkv, d});
  });
  add("misaligned reference", [&](PrefillInput* in) {
    in->k = region->Tensor(2, DType::kFp32, {8, hkv, d});
  });
  add("output region too small", [&](PrefillInput* in) { in->output_region = region->Ref(0, 64); });
  add("oversized region tensor", [&](PrefillInput* in) {
    in->q = client::TensorRef::In(region->id(), 0, DType::kFp32, {1 << 12, 5, hq, d});
  });
  for (const PrefillCase& c : prefills) {
    const absl::Status want = session_->Send(SessionPrefill(c.in)).status();
    const absl::Status got = ring_->Prefill(c.in).status();
    EXPECT_FALSE(want.ok()) << c.what;
    EXPECT_EQ(got.code(), want.code()) << c.what << ": " << got;
    EXPECT_EQ(got.message(), want.message()) << c.what;
    EXPECT_EQ(Held(), before) << c.what;
  }
  // A request larger than --max-message-bytes: the code gRPC gives the Session's (its own
  // message), before anything is read.
  {
    PrefillInput big = Prefill(a, 300);  // 300 * (5 * 4 + 2 * 2) * 64 * 4 bytes > 1 MiB
    const absl::Status want = session_->Send(SessionPrefill(big)).status();
    EXPECT_EQ(want.code(), absl::StatusCode::kResourceExhausted) << want;
    session_ = std::make_unique<SessionStream>(stub_.get());  // gRPC ended that stream
    const absl::Status got = ring_->Prefill(big).status();
    EXPECT_EQ(got.code(), absl::StatusCode::kResourceExhausted) << got;
    EXPECT_THAT(got.message(), HasSubstr("more than --max-message-bytes (1048576)"));
    EXPECT_EQ(Held(), before);
  }
  // Nothing advanced: the next token of each sequence is its 17th.
  absl::StatusOr<std::vector<client::DecodeResult>> next = ring_->Decode(1, {Entry(a), Entry(b)});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ((*next)[0].length, 17);
  EXPECT_EQ((*next)[1].length, 17);
  // Decode region errors name the packed tensor; past the name, the Session's message for the
  // same reference (entries form: packed decode carries no references).
  DecodeInput r = Entry(a);
  r.k_ref = client::TensorRef::In(std::string(32, 'e'), 0, DType::kFp32, {hkv, d});
  v1::SessionRequest entries_form;
  client::internal::BuildDecode(1, {r}, entries_form.mutable_decode());
  const absl::Status want = session_->Send(entries_form).status();
  const absl::Status got = ring_->Decode(1, {r}).status();
  EXPECT_EQ(got.code(), want.code());
  ASSERT_THAT(want.message(), HasSubstr("entries[0].k: "));
  EXPECT_EQ(got.message(), absl::StrCat("packed k: ", want.message().substr(14)));
}

TEST_F(RingV2Test, AnOutputTooLargeForTheHalfIsRefusedBeforeItRuns) {
  client::RingOptions small;
  small.half_bytes = 64 << 10;
  absl::StatusOr<std::unique_ptr<RingClient>> ring = RingClient::Open(c(), small);
  ASSERT_TRUE(ring.ok()) << ring.status();
  // q, k and v in a region keep the request small; o inline is 64 * 4 * 64 * 4 = 65,536 bytes,
  // more than the half's 65,528 with the response's header.
  auto buf = client::ShmBuffer::Create(1 << 20);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto region = client::RegisteredRegion::Shm(c(), **buf);
  ASSERT_TRUE(region.ok()) << region.status();
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const std::string a = NewSeq();
  PrefillInput in = Prefill(a, 64);
  std::memcpy((*buf)->data(), prefill_q_.data.data(), prefill_q_.data.size());
  in.q = region->Tensor(0, DType::kFp32, {64, 5, hq, d});
  in.k = region->Tensor(524288, DType::kFp32, {64, hkv, d});
  in.v = region->Tensor(655360, DType::kFp32, {64, hkv, d});
  const std::pair<int64_t, int64_t> before = Held();
  const absl::Status s = (*ring)->Prefill(in).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("does not fit the ring's response half (65528 bytes)"));
  EXPECT_EQ(Held(), before);
  // The sequence did not advance: its next prefill starts at 0.
  absl::StatusOr<client::PrefillResult> next = ring_->Prefill(Prefill(a, 4));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->length, 4);
}

TEST_F(RingV2Test, OpenRingNamesTheVersionsItServes) {
  client::RingOptions v3;
  v3.version = 3;
  absl::StatusOr<std::unique_ptr<RingClient>> ring = RingClient::Open(c(), v3);
  EXPECT_EQ(ring.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ring.status().message(),
              HasSubstr("the ring's header says version 3; this attnd serves version 1 "
                        "(serialized SessionRequest / SessionResponse) and version 2 (binary "
                        "frames, proto/attnd/v1/ring_frame.h)"));
  client::RingOptions v1_options;
  v1_options.version = 1;
  ring = RingClient::Open(c(), v1_options);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const std::string a = NewSeq();
  EXPECT_TRUE((*ring)->Prefill(Prefill(a, 4)).ok());
}

// A ring of 4 slots holds 4 micro-batches in flight: each submitted decode is answered with the
// Session's bytes for the same entries, collected in the order submitted, and the slots are
// reused step after step; posted together (SubmitDecodes), they run as one merged batch. A fifth
// submit, or a Decode or Prefill that would wait behind the uncollected ones, is refused and
// changes nothing.
TEST_F(RingV2Test, SlotsHoldSeveralMicroBatchesInFlight) {
  absl::StatusOr<v1::GetServerInfoResponse> info = c().Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->regions().max_ring_slots(), 16);
  client::RingOptions options;
  options.half_bytes = 256 << 10;
  options.slots = 4;
  absl::StatusOr<std::unique_ptr<RingClient>> opened = RingClient::Open(c(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  RingClient& ring = **opened;
  EXPECT_EQ(ring.buffer().size(), 4096 + 8 * (256u << 10));
  constexpr int kBatches = 4, kRows = 2;
  std::vector<std::string> ids, twins;
  for (int i = 0; i < kBatches * kRows; ++i) {
    ids.push_back(NewSeq());
    twins.push_back(NewSeq());
    PrefillInput in = Prefill(ids.back(), 5 + i);
    absl::StatusOr<client::PrefillResult> prefilled = ring.Prefill(in);
    ASSERT_TRUE(prefilled.ok()) << prefilled.status();
    in.sequence_id = twins.back();
    ASSERT_TRUE(session_->Send(SessionPrefill(in)).ok());
  }
  for (int step = 0; step < 3; ++step) {
    absl::StatusOr<v1::GetServerInfoResponse> before = c().Info();
    ASSERT_TRUE(before.ok()) << before.status();
    std::vector<std::vector<DecodeInput>> batches(kBatches);
    for (int b = 0; b < kBatches; ++b) {
      for (int r = 0; r < kRows; ++r) batches[b].push_back(Entry(ids[b * kRows + r]));
    }
    // One at a time (the server may take the first before the next is posted), or together.
    if (step == 0) {
      for (int b = 0; b < kBatches; ++b) {
        ASSERT_TRUE(ring.SubmitDecode(1, batches[b]).ok()) << b;
      }
    } else {
      ASSERT_TRUE(ring.SubmitDecodes(1, batches).ok());
    }
    EXPECT_EQ(ring.submitted(), 4u);
    const std::pair<int64_t, int64_t> held = Held();
    absl::Status refused = ring.SubmitDecode(1, {Entry(ids[0])});
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_THAT(refused.message(), HasSubstr("4 submitted decode(s) are uncollected"));
    for (int b = 0; b < kBatches; ++b) {
      absl::StatusOr<std::vector<client::DecodeResult>> got = ring.AwaitDecode();
      std::vector<DecodeInput> twin = batches[b];
      for (int r = 0; r < kRows; ++r) twin[r].sequence_id = twins[b * kRows + r];
      absl::StatusOr<v1::SessionResponse> want = session_->Send(PackedDecode(1, twin));
      ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
      ASSERT_EQ(got->size(), size_t{kRows});
      const std::string& o = want->decode().o().data();
      const size_t row = o.size() / kRows;
      for (int r = 0; r < kRows; ++r) {
        EXPECT_EQ((*got)[r].length, 5 + b * kRows + r + 1 + step);
        EXPECT_TRUE((*got)[r].o.data == o.substr(r * row, row)) << step << " " << b << " " << r;
      }
    }
    EXPECT_EQ(Held(), held) << "the refused calls changed what the daemon holds";
    absl::StatusOr<v1::GetServerInfoResponse> after = c().Info();
    ASSERT_TRUE(after.ok()) << after.status();
    ASSERT_TRUE(after->decode_batching().enabled());
    // Posted together, the ring's four micro-batches run as one batch (the Session twins'
    // decodes are one each). Under a sanitizer the ring's thread may take longer than the
    // batcher's wait for followers (500 us) between two posted frames, so there they may run
    // apart, each at most once.
    if (step > 0) {
      const int64_t batches =
          after->decode_batching().batches() - before->decode_batching().batches();
      if (kSanitized) {
        EXPECT_LE(batches, 2 * kBatches);
      } else {
        EXPECT_EQ(batches, 1 + kBatches);
      }
    }
    EXPECT_EQ(after->decode_batching().entries() - before->decode_batching().entries(),
              2 * kBatches * kRows);
    EXPECT_EQ(ring.AwaitDecode().status().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(ring.stats().round_trips, kBatches * kRows + 3 * kBatches);
}

// A Prefill or Decode while submitted decodes are uncollected (continuous batching prefills beside
// a decode step): each gets its own answer, and the submitted ones theirs, in any slot count.
TEST_F(RingV2Test, BlockingCallsRunBetweenSubmittedDecodes) {
  for (uint32_t slots : {1u, 2u}) {
    SCOPED_TRACE(slots);
    client::RingOptions options;
    options.half_bytes = 256 << 10;
    options.slots = slots;
    absl::StatusOr<std::unique_ptr<RingClient>> opened = RingClient::Open(c(), options);
    ASSERT_TRUE(opened.ok()) << opened.status();
    RingClient& ring = **opened;
    // Sequences decoded through submits (and their Session twins), and one prefilled and
    // decoded by blocking calls in between.
    std::vector<std::string> ids, twins;
    for (uint32_t i = 0; i < slots; ++i) {
      ids.push_back(NewSeq());
      twins.push_back(NewSeq());
      PrefillInput in = Prefill(ids.back(), 4 + i);
      ASSERT_TRUE(ring.Prefill(in).ok());
      in.sequence_id = twins.back();
      ASSERT_TRUE(session_->Send(SessionPrefill(in)).ok());
    }
    const std::string extra = NewSeq(), extra_twin = NewSeq();
    std::vector<std::vector<DecodeInput>> batches;
    for (const std::string& id : ids) batches.push_back({Entry(id)});
    ASSERT_TRUE(ring.SubmitDecodes(1, batches).ok());
    ASSERT_EQ(ring.submitted(), slots);

    PrefillInput in = Prefill(extra, 6);
    absl::StatusOr<client::PrefillResult> prefilled = ring.Prefill(in);
    in.sequence_id = extra_twin;
    absl::StatusOr<v1::SessionResponse> prefill_twin = session_->Send(SessionPrefill(in));
    ASSERT_TRUE(prefilled.ok() && prefill_twin.ok()) << prefilled.status() << prefill_twin.status();
    EXPECT_EQ(prefilled->length, 6);
    EXPECT_TRUE(prefilled->o.data == prefill_twin->prefill().o().data());
    const DecodeInput step = Entry(extra);
    absl::StatusOr<std::vector<client::DecodeResult>> decoded = ring.Decode(1, {step});
    DecodeInput twin_step = step;
    twin_step.sequence_id = extra_twin;
    absl::StatusOr<v1::SessionResponse> decode_twin = session_->Send(PackedDecode(1, {twin_step}));
    ASSERT_TRUE(decoded.ok() && decode_twin.ok()) << decoded.status() << decode_twin.status();
    ASSERT_EQ(decoded->size(), 1u);
    EXPECT_EQ((*decoded)[0].length, 7);
    EXPECT_TRUE((*decoded)[0].o.data == decode_twin->decode().o().data());

    EXPECT_EQ(ring.submitted(), slots);  // read out of their slots, still AwaitDecode's
    for (uint32_t i = 0; i < slots; ++i) {
      absl::StatusOr<std::vector<client::DecodeResult>> got = ring.AwaitDecode();
      std::vector<DecodeInput> twin = batches[i];
      twin[0].sequence_id = twins[i];
      absl::StatusOr<v1::SessionResponse> want = session_->Send(PackedDecode(1, twin));
      ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
      ASSERT_EQ(got->size(), 1u);
      EXPECT_EQ((*got)[0].length, 4 + static_cast<int64_t>(i) + 1);
      EXPECT_TRUE((*got)[0].o.data == want->decode().o().data()) << i;
    }
    EXPECT_EQ(ring.submitted(), 0u);
  }
}

// What a client asks of slots is judged before anything is created: a power of two up to 16,
// version 2 frames, no device events, and no more than the server's max_ring_slots.
TEST_F(RingV2Test, BadSlotOptionsAreRefusedBeforeTheRingExists) {
  struct Case {
    uint32_t slots, version;
    bool device_events;
    absl::StatusCode code;
    std::string message;
  };
  for (const Case& k : std::vector<Case>{
           {0, 2, false, absl::StatusCode::kInvalidArgument, "from 1 to 16, got 0"},
           {6, 2, false, absl::StatusCode::kInvalidArgument, "from 1 to 16, got 6"},
           {32, 2, false, absl::StatusCode::kInvalidArgument, "from 1 to 16, got 32"},
           {2, 1, false, absl::StatusCode::kInvalidArgument, "a ring of 2 slots needs version 2"},
           {2, 2, true, absl::StatusCode::kInvalidArgument, "one ring per micro-batch"},
       }) {
    client::RingOptions options;
    options.slots = k.slots;
    options.version = k.version;
    options.device_events = k.device_events;
    absl::StatusOr<std::unique_ptr<RingClient>> ring = RingClient::Open(c(), options);
    EXPECT_EQ(ring.status().code(), k.code) << ring.status();
    EXPECT_THAT(ring.status().message(), HasSubstr(k.message));
  }
  absl::StatusOr<v1::GetServerInfoResponse> info = c().Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->regions().rings(), true);
}

// A device-ordered ring needs attnd's CUDA backend on one GPU: the CPU daemon refuses the events
// at OpenRing, saying what it needs, and keeps no ring.
TEST_F(RingV2Test, DeviceEventsNeedTheCudaBackend) {
  client::RingOptions options;
  options.device_events = true;
  absl::StatusOr<std::unique_ptr<RingClient>> ring = RingClient::Open(c(), options);
  EXPECT_EQ(ring.status().code(), absl::StatusCode::kFailedPrecondition) << ring.status();
  EXPECT_THAT(ring.status().message(), HasSubstr("device_events need attnd on one CUDA GPU"));
  absl::StatusOr<v1::GetServerInfoResponse> info = c().Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->regions().device_ordered_rings());
  EXPECT_FALSE(info->regions().cuda_mps());  // no CUDA context at all
  // A version 1 ring is refused for what it is first.
  options.version = 1;
  ring = RingClient::Open(c(), options);
  EXPECT_EQ(ring.status().code(), absl::StatusCode::kInvalidArgument) << ring.status();
  EXPECT_THAT(ring.status().message(), HasSubstr("device_events need a version 2 ring"));
}

}  // namespace
}  // namespace attnd
