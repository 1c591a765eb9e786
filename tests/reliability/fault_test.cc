// Fault injection against an in-process attnd (AttndServer::Start on 127.0.0.1:0, CPU engine
// wrapped in server/engine/fault_engine.h's FaultEngine): engine failures, a lost device, clients
// that cancel, disconnect mid-stream or run out of deadline, garbage and truncated frames, a full
// pool. After each fault the daemon must still serve, a witness sequence created before the fault
// must read back exactly as the naive fp64 reference says (its KV unchanged), and no page may leak.
#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "client/attnd_client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/testing/naive_dca.h"
#include "server/engine/fault_engine.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

using client::HostTensor;
using testing::ModelGeometry;
using testing::RandomInputs;
using testing::TestDaemon;

constexpr int64_t kPageSize = 16;

int64_t PageBytes(const ModelGeometry& g) {  // fp32 K and V of every layer
  return 2ll * g.num_layers * kPageSize * g.num_kv_heads * g.head_dim * 4;
}

// A daemon whose engine is a FaultEngine the test drives.
struct FaultyDaemon {
  ModelGeometry geometry;
  FaultEngine* faults = nullptr;  // owned by the server's runtime
  std::unique_ptr<TestDaemon> daemon;

  explicit FaultyDaemon(int64_t pages, absl::Duration rpc_timeout = absl::Seconds(60)) {
    ServerOptions options;
    options.device = "cpu";
    options.kv_cache_bytes = pages * PageBytes(geometry);
    options.page_size = kPageSize;
    options.compute_threads = 2;
    options.wrap_engine = [this](std::unique_ptr<Engine> engine) -> std::unique_ptr<Engine> {
      auto wrapped = std::make_unique<FaultEngine>(std::move(engine));
      faults = wrapped.get();
      return wrapped;
    };
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(geometry, options);
    EXPECT_TRUE(d.ok()) << d.status();
    if (d.ok()) daemon = *std::move(d);
  }
  client::AttndClient& client() { return daemon->client(); }
  std::unique_ptr<v1::Attention::Stub> Stub() const {
    return v1::Attention::NewStub(
        grpc::CreateChannel(daemon->target(), grpc::InsecureChannelCredentials()));
  }
  int64_t PagesFree() {
    absl::StatusOr<v1::GetServerInfoResponse> info = client().Info();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->kv_cache().pages_free() : -1;
  }
  int64_t PagesTotal() {
    absl::StatusOr<v1::GetServerInfoResponse> info = client().Info();
    return info.ok() ? info->kv_cache().pages_total() : -1;
  }
  int64_t Live() {
    absl::StatusOr<v1::GetServerInfoResponse> info = client().Info();
    return info.ok() ? info->live_sequences() : -1;
  }
};

// A sequence mirrored by the naive reference: every successful call is replayed on the mirror and
// the outputs must agree.
class Witness {
 public:
  Witness(FaultyDaemon* d, uint32_t seed)
      : d_(d), rng_(seed), naive_(d->geometry.dca(), d->geometry.num_layers) {
    absl::StatusOr<std::string> id = d->client().CreateSequence();
    EXPECT_TRUE(id.ok()) << id.status();
    if (id.ok()) id_ = *id;
  }
  const std::string& id() const { return id_; }

  void Prefill(int64_t tokens) {
    const ModelGeometry& g = d_->geometry;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      std::vector<float> q = RandomInputs(&rng_, tokens * g.q_elems_per_token());
      std::vector<float> k = RandomInputs(&rng_, tokens * g.kv_elems_per_token());
      std::vector<float> v = RandomInputs(&rng_, tokens * g.kv_elems_per_token());
      const int64_t prompt_len = naive_.length(layer) + tokens;
      auto got = d_->client().Prefill(
          id_, layer,
          HostTensor::FromFloats(DType::kFp32, {tokens, 5, g.num_q_heads, g.head_dim}, q),
          HostTensor::FromFloats(DType::kFp32, {tokens, g.num_kv_heads, g.head_dim}, k),
          HostTensor::FromFloats(DType::kFp32, {tokens, g.num_kv_heads, g.head_dim}, v),
          prompt_len);
      ASSERT_TRUE(got.ok()) << got.status();
      absl::StatusOr<std::vector<float>> want = naive_.Prefill(layer, q, k, v, prompt_len);
      ASSERT_TRUE(want.ok()) << want.status();
      Check(got->o.ToFloats(), *want, "prefill");
    }
  }

  // One decode token in every layer, checked against the reference: proves the cached KV is the
  // one the witness wrote.
  void DecodeAndCheck() {
    const ModelGeometry& g = d_->geometry;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      std::vector<float> q = RandomInputs(&rng_, 3ll * g.num_q_heads * g.head_dim);
      std::vector<float> k = RandomInputs(&rng_, g.kv_elems_per_token());
      std::vector<float> v = RandomInputs(&rng_, g.kv_elems_per_token());
      client::DecodeInput in{
          id_, HostTensor::FromFloats(DType::kFp32, {3, g.num_q_heads, g.head_dim}, q),
          HostTensor::FromFloats(DType::kFp32, {g.num_kv_heads, g.head_dim}, k),
          HostTensor::FromFloats(DType::kFp32, {g.num_kv_heads, g.head_dim}, v)};
      auto got = d_->client().Decode(layer, {in});
      ASSERT_TRUE(got.ok()) << got.status();
      absl::StatusOr<std::vector<float>> want = naive_.Decode(layer, q, k, v);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_EQ(got->size(), 1u);
      EXPECT_EQ((*got)[0].length, naive_.length(layer));
      Check((*got)[0].o.ToFloats(), *want, "decode");
    }
  }

 private:
  void Check(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    testing::ErrorStats e = testing::CompareOutputs(got, want);
    EXPECT_TRUE(e.finite) << what;
    EXPECT_LT(e.max_abs, 2e-5) << what << " of witness " << id_ << " differs from the reference";
  }

  FaultyDaemon* d_;
  std::mt19937 rng_;
  naive::NaiveSequence naive_;
  std::string id_;
};

// fp32 request builders for the raw stubs.
v1::Tensor Tensor(std::vector<int64_t> shape, std::mt19937* rng) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<float> values = RandomInputs(rng, n);
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FP32);
  for (int64_t s : shape) t.add_shape(s);
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  return t;
}

v1::PrefillRequest MakePrefill(const ModelGeometry& g, const std::string& id, int32_t layer,
                               int64_t tokens, std::mt19937* rng) {
  v1::PrefillRequest r;
  r.set_sequence_id(id);
  r.set_layer(layer);
  *r.mutable_q() = Tensor({tokens, 5, g.num_q_heads, g.head_dim}, rng);
  *r.mutable_k() = Tensor({tokens, g.num_kv_heads, g.head_dim}, rng);
  *r.mutable_v() = Tensor({tokens, g.num_kv_heads, g.head_dim}, rng);
  return r;
}

// The layer's cached length, learnt by appending one more token (the call's returned length - 1).
int64_t LengthOf(FaultyDaemon* d, const std::string& id, int32_t layer, std::mt19937* rng) {
  auto stub = d->Stub();
  grpc::ClientContext context;
  v1::PrefillResponse response;
  grpc::Status s = stub->Prefill(&context, MakePrefill(d->geometry, id, layer, 1, rng), &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response.length() - 1;
}

void ExpectNoLeak(FaultyDaemon* d, const std::vector<std::string>& release) {
  for (const std::string& id : release) {
    absl::StatusOr<int64_t> freed = d->client().Release(id);
    EXPECT_TRUE(freed.ok()) << freed.status();
  }
  EXPECT_EQ(d->Live(), 0);
  EXPECT_EQ(d->PagesFree(), d->PagesTotal());
}

TEST(FaultTest, EngineFailureFailsOnlyTheAffectedRpcs) {
  FaultyDaemon d(64);
  ASSERT_NE(d.faults, nullptr);
  Witness w(&d, 1);
  w.Prefill(40);
  std::mt19937 rng(2);
  std::string other = *d.client().CreateSequence();
  const int64_t free_before = d.PagesFree();

  // The next prefill fails inside the engine: INTERNAL, and the pages it reserved come back.
  d.faults->FailNextPrefills(1);
  auto stub = d.Stub();
  {
    grpc::ClientContext context;
    v1::PrefillResponse response;
    grpc::Status s =
        stub->Prefill(&context, MakePrefill(d.geometry, other, 0, 100, &rng), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL) << s.error_message();
    EXPECT_FALSE(s.error_message().empty());
  }
  EXPECT_EQ(d.PagesFree(), free_before);
  EXPECT_EQ(d.faults->injected_failures(), 1);
  EXPECT_EQ(LengthOf(&d, other, 0, &rng), 0);  // nothing was committed
  w.DecodeAndCheck();

  // Every job on layer 1 fails; layer 0 keeps working for everyone.
  d.faults->FailLayer(1);
  {
    grpc::ClientContext context;
    v1::PrefillResponse response;
    grpc::Status s = stub->Prefill(&context, MakePrefill(d.geometry, other, 1, 8, &rng), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL) << s.error_message();
  }
  d.faults->FailNextDecodes(3);  // decodes fail too, whatever their layer
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    v1::DecodeResponse response;
    v1::DecodeRequest request;
    request.set_layer(0);
    v1::DecodeEntry* e = request.add_entries();
    e->set_sequence_id(w.id());
    *e->mutable_q() = Tensor({3, d.geometry.num_q_heads, d.geometry.head_dim}, &rng);
    *e->mutable_k() = Tensor({d.geometry.num_kv_heads, d.geometry.head_dim}, &rng);
    *e->mutable_v() = Tensor({d.geometry.num_kv_heads, d.geometry.head_dim}, &rng);
    grpc::Status s = stub->Decode(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL) << s.error_message();
  }
  d.faults->FailLayer(-1);
  w.DecodeAndCheck();  // the failed decodes left the witness untouched
  EXPECT_TRUE(*d.client().Healthy(""));
  ExpectNoLeak(&d, {w.id(), other});
}

TEST(FaultTest, LostDeviceTurnsHealthNotServing) {
  FaultyDaemon d(32);
  ASSERT_NE(d.faults, nullptr);
  Witness w(&d, 3);
  w.Prefill(20);
  ASSERT_TRUE(*d.client().Healthy(""));
  ASSERT_TRUE(*d.client().Healthy("attnd.v1.Attention"));
  d.faults->LoseDevice();
  std::mt19937 rng(4);
  auto stub = d.Stub();
  grpc::ClientContext context;
  v1::PrefillResponse response;
  grpc::Status s = stub->Prefill(&context, MakePrefill(d.geometry, w.id(), 0, 4, &rng), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL) << s.error_message();
  bool serving = true;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (serving && absl::Now() < give_up) {
    absl::StatusOr<bool> h = d.client().Healthy("attnd.v1.Attention");
    ASSERT_TRUE(h.ok()) << h.status();
    serving = *h;
    if (serving) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_FALSE(serving) << "health still SERVING 10 s after the device was lost";
  EXPECT_FALSE(*d.client().Healthy(""));
  // Bookkeeping still answers: info, release, and no page leaked by the failed calls.
  ExpectNoLeak(&d, {w.id()});
}

TEST(FaultTest, SessionCancelledWithARequestInFlight) {
  FaultyDaemon d(128);
  Witness w(&d, 5);
  w.Prefill(30);
  std::mt19937 rng(6);
  std::vector<std::string> ids;
  for (int round = 0; round < 10; ++round) {
    const std::string id = *d.client().CreateSequence();
    ids.push_back(id);
    auto stub = d.Stub();
    grpc::ClientContext context;
    auto stream = stub->Session(&context);
    v1::SessionRequest request;
    request.set_tag(1);
    *request.mutable_prefill() = MakePrefill(d.geometry, id, 0, 256, &rng);
    ASSERT_TRUE(stream->Write(request));
    // Disconnect at a different moment each round: before, during or after the compute.
    std::this_thread::sleep_for(std::chrono::milliseconds(round * 3));
    context.TryCancel();
    v1::SessionResponse response;
    while (stream->Read(&response)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
    const int64_t length = LengthOf(&d, id, 0, &rng);
    EXPECT_TRUE(length == 0 || length == 256) << "not all-or-nothing: " << length;
  }
  w.DecodeAndCheck();
  ids.push_back(w.id());
  ExpectNoLeak(&d, ids);
}

TEST(FaultTest, CancelledAndExpiredUnaryCalls) {
  // Room for every round's 16 pages: a call cancelled while it runs still completes, and whether
  // it does depends on timing; the pool must not be what fails it.
  FaultyDaemon d(256);
  Witness w(&d, 7);
  w.Prefill(50);
  std::mt19937 rng(8);
  std::vector<std::string> ids;
  int cancelled = 0, expired = 0;
  for (int round = 0; round < 12; ++round) {
    const std::string id = *d.client().CreateSequence();
    ids.push_back(id);
    auto stub = d.Stub();
    grpc::ClientContext context;
    const bool use_deadline = round % 2 == 1;
    if (use_deadline) {
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(round));
    }
    v1::PrefillRequest request = MakePrefill(d.geometry, id, 0, 256, &rng);
    std::thread canceller([&context, round, use_deadline] {
      if (use_deadline) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(round));
      context.TryCancel();
    });
    v1::PrefillResponse response;
    grpc::Status s = stub->Prefill(&context, request, &response);
    canceller.join();
    if (s.error_code() == grpc::StatusCode::CANCELLED) ++cancelled;
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) ++expired;
    EXPECT_TRUE(s.ok() || s.error_code() == grpc::StatusCode::CANCELLED ||
                s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        << s.error_code() << " " << s.error_message();
    const int64_t length = LengthOf(&d, id, 0, &rng);
    EXPECT_TRUE(length == 0 || length == 256) << "not all-or-nothing: " << length;
    if (s.ok()) {
      EXPECT_EQ(length, 256);
    }
  }
  // An already expired deadline is always refused and changes nothing.
  {
    auto stub = d.Stub();
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() - std::chrono::seconds(1));
    v1::PrefillResponse response;
    grpc::Status s =
        stub->Prefill(&context, MakePrefill(d.geometry, w.id(), 0, 8, &rng), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    ++expired;
  }
  std::printf("cancelled %d, deadline exceeded %d of 13 calls\n", cancelled, expired);
  EXPECT_GE(cancelled + expired, 1);
  w.DecodeAndCheck();
  ids.push_back(w.id());
  ExpectNoLeak(&d, ids);
}

// Raw bytes over a generic stub: garbage, truncated messages, messages of the wrong type.
grpc::Status RawUnary(const std::string& target, const std::string& method,
                      const std::string& bytes) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::CompletionQueue cq;
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  auto call = stub.PrepareUnaryCall(&context, method, request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

TEST(FaultTest, GarbageTruncatedAndMistypedFrames) {
  FaultyDaemon d(64);
  Witness w(&d, 9);
  w.Prefill(24);
  std::mt19937 rng(10);
  const std::string target = d.daemon->target();
  std::string prefill;
  MakePrefill(d.geometry, w.id(), 0, 4, &rng).SerializeToString(&prefill);
  v1::DecodeRequest decode;
  decode.set_layer(0);
  v1::DecodeEntry* e = decode.add_entries();
  e->set_sequence_id(w.id());
  *e->mutable_q() = Tensor({3, d.geometry.num_q_heads, d.geometry.head_dim}, &rng);
  std::string decode_bytes;
  decode.SerializeToString(&decode_bytes);

  std::vector<std::pair<std::string, std::string>> cases;
  const std::string methods[] = {"/attnd.v1.Attention/Prefill", "/attnd.v1.Attention/Decode",
                                 "/attnd.v1.Attention/ReleaseSequence"};
  for (const std::string& m : methods) {
    std::string garbage(200, '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    cases.push_back({m, garbage});
    cases.push_back({m, std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11)});
    cases.push_back({m, prefill.substr(0, prefill.size() / 2)});  // truncated
    cases.push_back({m, decode_bytes.substr(0, decode_bytes.size() - 3)});
  }
  cases.push_back({"/attnd.v1.Attention/Prefill", decode_bytes});  // wrong message types
  cases.push_back({"/attnd.v1.Attention/Decode", prefill});
  cases.push_back({"/attnd.v1.Attention/NoSuchMethod", prefill});
  // The same path with well-formed bytes works: the refusals below are about the bytes.
  const std::string scratch = *d.client().CreateSequence();
  {
    std::string ok_prefill;
    MakePrefill(d.geometry, scratch, 0, 4, &rng).SerializeToString(&ok_prefill);
    grpc::Status s = RawUnary(target, "/attnd.v1.Attention/Prefill", ok_prefill);
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  }
  int refused = 0;
  for (const auto& [method, bytes] : cases) {
    grpc::Status s = RawUnary(target, method, bytes);
    // Refused, never OK and never a crash. attnd parses the bytes itself (raw methods): bytes that
    // do not parse get INVALID_ARGUMENT "cannot parse attnd.v1.<Request>..."; bytes that parse (as
    // the wrong message) are validated and refused with what is wrong. Only an unknown method is
    // gRPC's own UNIMPLEMENTED.
    EXPECT_FALSE(s.ok()) << method << " accepted " << bytes.size() << " bytes of junk";
    if (method == "/attnd.v1.Attention/NoSuchMethod") {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
    } else {
      EXPECT_TRUE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                  s.error_code() == grpc::StatusCode::NOT_FOUND)
          << method << " code " << s.error_code() << " " << s.error_message();
      EXPECT_FALSE(s.error_message().empty()) << method << " code " << s.error_code();
    }
    if (!s.ok()) ++refused;
  }
  std::printf("%d of %zu junk frames refused\n", refused, cases.size());

  // Junk on the Session stream: a request with neither prefill nor decode is answered with
  // INVALID_ARGUMENT and the stream goes on; then the client vanishes mid-stream.
  {
    auto stub = d.Stub();
    grpc::ClientContext context;
    auto stream = stub->Session(&context);
    v1::SessionRequest empty;
    empty.set_tag(7);
    ASSERT_TRUE(stream->Write(empty));
    v1::SessionResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.tag(), 7u);
    EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    v1::SessionRequest wrong;
    wrong.set_tag(8);
    *wrong.mutable_decode() = decode;  // missing k and v
    ASSERT_TRUE(stream->Write(wrong));
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    context.TryCancel();
  }
  w.DecodeAndCheck();
  ExpectNoLeak(&d, {w.id(), scratch});
}

TEST(FaultTest, HammerAFullPool) {
  constexpr int64_t kPages = 24;
  FaultyDaemon d(kPages);
  Witness w(&d, 11);
  w.Prefill(32);  // 2 pages
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      auto stub = d.Stub();
      for (int i = 0; i < 15; ++i) {
        grpc::ClientContext c1;
        v1::CreateSequenceResponse created;
        grpc::Status s = stub->CreateSequence(&c1, v1::CreateSequenceRequest(), &created);
        if (!s.ok()) {
          ++other;
          continue;
        }
        // 80 tokens = 5 pages; four clients at once want 20 of the 22 pages left, and they hold
        // them a while: some must be refused.
        grpc::ClientContext c2;
        v1::PrefillResponse response;
        s = stub->Prefill(
            &c2, MakePrefill(d.geometry, created.sequence_id(), 0, 80 + 16 * (i % 3), &rng),
            &response);
        if (s.ok()) {
          ++ok;
        } else if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          ++exhausted;
          EXPECT_FALSE(s.error_message().empty());
        } else {
          ++other;
          ADD_FAILURE() << s.error_code() << " " << s.error_message();
        }
        grpc::ClientContext c3;
        v1::ReleaseSequenceRequest release;
        release.set_sequence_id(created.sequence_id());
        v1::ReleaseSequenceResponse released;
        EXPECT_TRUE(stub->ReleaseSequence(&c3, release, &released).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::printf("full pool: %d prefills ok, %d RESOURCE_EXHAUSTED, %d other\n", ok.load(),
              exhausted.load(), other.load());
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(ok.load(), 0);
  // A prefill larger than the whole pool is always refused, deterministically.
  {
    std::mt19937 rng(12);
    std::string id = *d.client().CreateSequence();
    auto stub = d.Stub();
    grpc::ClientContext context;
    v1::PrefillResponse response;
    grpc::Status s = stub->Prefill(
        &context, MakePrefill(d.geometry, id, 0, kPages * kPageSize, &rng), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_EQ(*d.client().Release(id), 0);
  }
  w.DecodeAndCheck();
  ExpectNoLeak(&d, {w.id()});
}

}  // namespace
}  // namespace attnd
