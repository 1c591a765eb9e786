// The daemon in-process on 127.0.0.1:0 with the tiny model, driven over real gRPC: server info,
// a create/prefill/decode/release round trip against the fp64 reference, a Session stream that
// survives a failing request, health, the message size limit and a prompt shutdown.
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/v1/admin.grpc.pb.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "base/dtype.h"
#include "base/mutex.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/testing/naive_dca.h"
#include "server/engine/engine.h"
#include "server/engine/prefill_step_hook_for_testing.h"
#include "server/rpc/server.h"

namespace attnd {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 64;
constexpr int64_t kPages = 64;
constexpr int64_t kPageBytes = 32768;  // fp32 KV: 2 layers x K,V x 16 x 2 x 64 x 4 bytes

ServerOptions TinyOptions() {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.model_config = "configs/tiny/config.json";
  o.device = "cpu";
  o.kv_cache_bytes = kPages * kPageBytes;
  o.page_size = 16;
  o.max_message_bytes = 1 << 20;
  o.max_sequence_length = 1024;
  o.compute_threads = 2;
  o.request_workers = 4;
  return o;
}

DcaGeometry TinyGeometry() {
  DcaGeometry g;
  g.num_q_heads = kHq;
  g.num_kv_heads = kHkv;
  g.head_dim = kD;
  g.chunk_len = 128;
  g.original_max_position_embeddings = 256;
  g.softmax_scale = 0.125f;
  return g;
}

// Fills `t` with random fp32 data of `shape`; returns the values.
std::vector<float> RandomTensor(std::vector<int64_t> shape, std::mt19937* rng, v1::Tensor* t) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> values(n);
  for (float& x : values) x = dist(*rng);
  t->set_dtype(v1::DTYPE_FP32);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  t->set_data(values.data(), values.size() * sizeof(float));
  return values;
}

void ExpectMatches(const v1::Tensor& got, std::vector<int64_t> shape,
                   const std::vector<float>& want, const std::string& what) {
  EXPECT_EQ(got.dtype(), v1::DTYPE_FP32) << what;
  EXPECT_EQ(std::vector<int64_t>(got.shape().begin(), got.shape().end()), shape) << what;
  ASSERT_EQ(got.data().size(), want.size() * sizeof(float)) << what;
  std::vector<float> values(want.size());
  ConvertToFloat(got.data().data(), DType::kFp32, values.size(), values.data());
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_NEAR(values[i], want[i], 1e-4) << what << " element " << i;
  }
}

class ServiceTest : public testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(TinyOptions());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Attention::NewStub(channel_);
  }
  void TearDown() override {
    if (server_ != nullptr) {
      server_->Shutdown(absl::Now() + absl::Seconds(5));
      server_->Wait();
    }
  }

  std::string Create() {
    grpc::ClientContext ctx;
    v1::CreateSequenceRequest req;
    v1::CreateSequenceResponse resp;
    grpc::Status s = stub_->CreateSequence(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.sequence_id();
  }

  // grpc.health.v1.Health/Check through the generic stub (no health proto stubs here): the request
  // is field 1 (service name), the response field 1 (1 = SERVING, 2 = NOT_SERVING).
  grpc::Status HealthCheck(const std::string& service, std::string* response_bytes) {
    grpc::GenericStub generic(channel_);
    std::string request =
        absl::StrCat("\x0a", std::string(1, static_cast<char>(service.size())), service);
    grpc::Slice slice(request);
    grpc::ByteBuffer req(&slice, 1), resp;
    grpc::ClientContext ctx;
    grpc::Status status;
    Notification done;
    generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                      [&](grpc::Status s) {
                        status = s;
                        done.Notify();
                      });
    done.WaitForNotification();
    std::vector<grpc::Slice> slices;
    if (status.ok()) {
      resp.Dump(&slices);
      response_bytes->clear();
      for (const grpc::Slice& s : slices) {
        response_bytes->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return status;
  }

  std::mt19937 rng_{3};
  std::unique_ptr<AttndServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

TEST_F(ServiceTest, GetServerInfoFillsEveryField) {
  const std::string id = Create();
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_FALSE(info.device().empty());
  EXPECT_FALSE(info.model().name().empty());
  EXPECT_EQ(info.model().num_layers(), 2);
  EXPECT_EQ(info.model().num_q_heads(), 4);
  EXPECT_EQ(info.model().num_kv_heads(), 2);
  EXPECT_EQ(info.model().head_dim(), 64);
  EXPECT_EQ(info.model().kv_dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(info.model().max_position_embeddings(), 4096);
  EXPECT_FLOAT_EQ(info.model().softmax_scale(), 0.125f);
  EXPECT_EQ(info.model().rope_theta(), 10000.0);
  EXPECT_EQ(info.model().partial_rotary_factor(), 1.f);
  EXPECT_EQ(info.model().rotary_dim(), 64);
  EXPECT_EQ(info.dca().chunk_size(), 160);
  EXPECT_EQ(info.dca().local_size(), 32);
  EXPECT_EQ(info.dca().chunk_len(), 128);
  EXPECT_EQ(info.dca().original_max_position_embeddings(), 256);
  EXPECT_FALSE(info.dca().sparse_attention_enabled());
  EXPECT_EQ(info.dca().sparse_attention_threshold(), 32768);
  EXPECT_EQ(info.dca().sparse_attention_last_q(), 64);
  EXPECT_EQ(info.kv_cache().page_size(), 16);
  EXPECT_EQ(info.kv_cache().pages_total(), kPages);
  EXPECT_EQ(info.kv_cache().pages_free(), kPages);
  EXPECT_EQ(info.kv_cache().bytes_per_page(), kPageBytes);
  EXPECT_EQ(info.kv_cache().pool_bytes(), kPages * kPageBytes);
  EXPECT_EQ(info.live_sequences(), 1);
  EXPECT_EQ(info.limits().max_message_bytes(), 1 << 20);
  EXPECT_EQ(info.limits().max_sequence_length(), 1024);
  EXPECT_EQ(info.limits().max_sequences(), kPages);  // by default one per page
  EXPECT_EQ(info.limits().tenant_max_sequences(), 0);
  EXPECT_FALSE(info.tenant_scoped());
  EXPECT_NE(server_->startup_summary().find(absl::StrCat("127.0.0.1:", server_->port())),
            std::string::npos)
      << server_->startup_summary();
}

TEST_F(ServiceTest, HealthIsServingForTheServerAndTheService) {
  std::string resp;
  ASSERT_TRUE(HealthCheck("", &resp).ok());
  EXPECT_EQ(resp, std::string("\x08\x01", 2));
  ASSERT_TRUE(HealthCheck("attnd.v1.Attention", &resp).ok());
  EXPECT_EQ(resp, std::string("\x08\x01", 2));
  EXPECT_EQ(HealthCheck("no.such.Service", &resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, RoundTripMatchesTheNaiveReference) {
  const std::string id = Create();
  ASSERT_EQ(id.size(), 32u);
  naive::NaiveSequence ref(TinyGeometry(), 2);
  // A 150-token prompt (crosses the chunk boundary at 128) into each layer.
  for (int32_t layer = 0; layer < 2; ++layer) {
    v1::PrefillRequest req;
    req.set_sequence_id(id);
    req.set_layer(layer);
    req.set_prompt_len(150);
    std::vector<float> q = RandomTensor({150, 5, kHq, kD}, &rng_, req.mutable_q());
    std::vector<float> k = RandomTensor({150, kHkv, kD}, &rng_, req.mutable_k());
    std::vector<float> v = RandomTensor({150, kHkv, kD}, &rng_, req.mutable_v());
    grpc::ClientContext ctx;
    v1::PrefillResponse resp;
    grpc::Status s = stub_->Prefill(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.length(), 150);
    absl::StatusOr<std::vector<float>> want = ref.Prefill(layer, q, k, v, 150);
    ASSERT_TRUE(want.ok());
    ExpectMatches(resp.o(), {150, kHq, kD}, *want, absl::StrCat("prefill layer ", layer));
  }
  for (int32_t layer = 0; layer < 2; ++layer) {
    v1::DecodeRequest req;
    req.set_layer(layer);
    v1::DecodeEntry* e = req.add_entries();
    e->set_sequence_id(id);
    std::vector<float> q = RandomTensor({3, kHq, kD}, &rng_, e->mutable_q());
    std::vector<float> k = RandomTensor({kHkv, kD}, &rng_, e->mutable_k());
    std::vector<float> v = RandomTensor({kHkv, kD}, &rng_, e->mutable_v());
    grpc::ClientContext ctx;
    v1::DecodeResponse resp;
    grpc::Status s = stub_->Decode(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.outputs_size(), 1);
    EXPECT_EQ(resp.outputs(0).length(), 151);
    absl::StatusOr<std::vector<float>> want = ref.Decode(layer, q, k, v);
    ASSERT_TRUE(want.ok());
    ExpectMatches(resp.outputs(0).o(), {kHq, kD}, *want, absl::StrCat("decode layer ", layer));
  }
  {
    grpc::ClientContext ctx;
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(id);
    v1::ReleaseSequenceResponse resp;
    ASSERT_TRUE(stub_->ReleaseSequence(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.pages_freed(), 10);  // 151 tokens in pages of 16
  }
  {
    grpc::ClientContext ctx;
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(id);
    v1::ReleaseSequenceResponse resp;
    grpc::Status s = stub_->ReleaseSequence(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(s.error_message(), absl::StrCat("sequence ", id, " not found"));
  }
}

// Prefill replies through server/rpc/wire.h are byte for byte what protobuf serializes (the same
// request to a server with the fast path off), and a request that is not the simple shape (an
// unknown field, as from a newer client) still goes through protobuf and gets the same answer.
TEST_F(ServiceTest, PrefillIsTheSameWithAndWithoutTheWireFastPath) {
  ServerOptions off = TinyOptions();
  off.wire_fast_path = false;
  absl::StatusOr<std::unique_ptr<AttndServer>> plain = AttndServer::Start(off);
  ASSERT_TRUE(plain.ok()) << plain.status();
  std::shared_ptr<grpc::Channel> plain_channel = grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", (*plain)->port()), grpc::InsecureChannelCredentials());
  auto raw_prefill = [](const std::shared_ptr<grpc::Channel>& channel, const std::string& bytes,
                        std::string* reply) {
    grpc::GenericStub generic(channel);
    grpc::Slice slice(bytes);
    grpc::ByteBuffer req(&slice, 1), resp;
    grpc::ClientContext ctx;
    grpc::Status status;
    Notification done;
    generic.UnaryCall(&ctx, "/attnd.v1.Attention/Prefill", grpc::StubOptions(), &req, &resp,
                      [&](grpc::Status s) {
                        status = s;
                        done.Notify();
                      });
    done.WaitForNotification();
    std::vector<grpc::Slice> slices;
    reply->clear();
    if (status.ok() && resp.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        reply->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return status;
  };
  auto create = [](const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext ctx;
    v1::CreateSequenceResponse resp;
    EXPECT_TRUE(v1::Attention::NewStub(channel)
                    ->CreateSequence(&ctx, v1::CreateSequenceRequest(), &resp)
                    .ok());
    return resp.sequence_id();
  };
  v1::PrefillRequest req;
  req.set_layer(1);
  req.set_prompt_len(140);
  RandomTensor({140, 5, kHq, kD}, &rng_, req.mutable_q());
  RandomTensor({140, kHkv, kD}, &rng_, req.mutable_k());
  RandomTensor({140, kHkv, kD}, &rng_, req.mutable_v());
  std::string fast, slow, unknown;
  req.set_sequence_id(Create());
  ASSERT_TRUE(raw_prefill(channel_, req.SerializeAsString(), &fast).ok());
  req.set_sequence_id(create(plain_channel));
  ASSERT_TRUE(raw_prefill(plain_channel, req.SerializeAsString(), &slow).ok());
  req.set_sequence_id(Create());
  // Field 15, varint 1: unknown to this proto; protobuf keeps it as an unknown field.
  ASSERT_TRUE(
      raw_prefill(channel_, req.SerializeAsString() + std::string("\x78\x01", 2), &unknown).ok());
  EXPECT_GT(fast.size(), 140u * kHq * kD * 4);
  EXPECT_TRUE(fast == slow) << "the fast path's reply differs from protobuf's";
  EXPECT_TRUE(fast == unknown) << "the protobuf fallback's reply differs";
  // Errors are the runtime's, as before.
  req.set_layer(2);
  grpc::Status s = raw_prefill(channel_, req.SerializeAsString(), &fast);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  (*plain)->Shutdown(absl::Now() + absl::Seconds(5));
  (*plain)->Wait();
}

// A unary Prefill whose deadline passes while it runs stops between two device steps and changes
// nothing: the next call on the sequence starts from length 0. (Without the check, the call ran to
// the end and committed 140 tokens the client was told had failed.) Both unary paths: the wire
// fast path and protobuf.
TEST_F(ServiceTest, APrefillPastItsDeadlineStopsBetweenStepsAndChangesNothing) {
  for (const bool wire : {true, false}) {
    ServerOptions o = TinyOptions();
    o.wire_fast_path = wire;
    o.prefill_step_keys = 1;  // 1 + 140 steps of >= 3 ms
    o.wrap_engine = [](std::unique_ptr<Engine> inner) -> std::unique_ptr<Engine> {
      return std::make_unique<PrefillStepHook>(std::move(inner), [] {
        absl::SleepFor(absl::Milliseconds(3));  // a slow step: the call outlives its deadline
        return absl::OkStatus();
      });
    };
    absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    auto stub = v1::Attention::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials()));
    std::string id;
    {
      grpc::ClientContext ctx;
      v1::CreateSequenceResponse resp;
      ASSERT_TRUE(stub->CreateSequence(&ctx, v1::CreateSequenceRequest(), &resp).ok());
      id = resp.sequence_id();
    }
    v1::PrefillRequest req;
    req.set_sequence_id(id);
    req.set_layer(0);
    RandomTensor({140, 5, kHq, kD}, &rng_, req.mutable_q());
    RandomTensor({140, kHkv, kD}, &rng_, req.mutable_k());
    RandomTensor({140, kHkv, kD}, &rng_, req.mutable_v());
    v1::PrefillResponse resp;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(150));
      EXPECT_EQ(stub->Prefill(&ctx, req, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
          << "wire " << wire;
    }
    // Waits for the sequence, which the stopped call holds until it has rolled back.
    v1::PrefillRequest one;
    one.set_sequence_id(id);
    one.set_layer(0);
    RandomTensor({1, 5, kHq, kD}, &rng_, one.mutable_q());
    RandomTensor({1, kHkv, kD}, &rng_, one.mutable_k());
    RandomTensor({1, kHkv, kD}, &rng_, one.mutable_v());
    {
      grpc::ClientContext ctx;
      ASSERT_TRUE(stub->Prefill(&ctx, one, &resp).ok()) << "wire " << wire;
      EXPECT_EQ(resp.length(), 1) << "wire " << wire;
    }
    grpc::ClientContext ctx;
    v1::GetServerInfoResponse info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    EXPECT_EQ(info.kv_cache().pages_free(), kPages - 1) << "wire " << wire;
    (*server)->Shutdown(absl::Now() + absl::Seconds(5));
    (*server)->Wait();
  }
}

TEST_F(ServiceTest, UnaryErrorsCarryCodeAndMessage) {
  const std::string id = Create();
  v1::PrefillRequest req;
  req.set_sequence_id(id);
  RandomTensor({2, 5, kHq, kD}, &rng_, req.mutable_q());
  RandomTensor({2, kHkv, kD}, &rng_, req.mutable_k());
  RandomTensor({2, kHkv, kD}, &rng_, req.mutable_v());
  req.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED);
  grpc::ClientContext ctx;
  v1::PrefillResponse resp;
  grpc::Status s = stub_->Prefill(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "q dtype must be bf16, fp16 or fp32, got unspecified (0)");

  v1::DecodeRequest dreq;
  dreq.set_layer(0);
  v1::DecodeEntry* e = dreq.add_entries();
  e->set_sequence_id(id);
  RandomTensor({3, kHq, kD}, &rng_, e->mutable_q());
  RandomTensor({kHkv, kD}, &rng_, e->mutable_k());
  RandomTensor({kHkv, kD}, &rng_, e->mutable_v());
  grpc::ClientContext dctx;
  v1::DecodeResponse dresp;
  s = stub_->Decode(&dctx, dreq, &dresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(s.error_message(), absl::StrCat("entries[0]: layer 0 of sequence ", id,
                                            " holds no tokens; prefill it before decoding"));
}

// The packed form (one q, k, v tensor per batch, one o back) against the reference, unary and in a
// Session; a malformed packed request is refused with what was expected and changes nothing.
TEST_F(ServiceTest, PackedDecodeMatchesTheNaiveReference) {
  const std::vector<std::string> ids = {Create(), Create()};
  std::vector<naive::NaiveSequence> refs(2, naive::NaiveSequence(TinyGeometry(), 2));
  for (int i = 0; i < 2; ++i) {
    v1::PrefillRequest req;
    req.set_sequence_id(ids[i]);
    std::vector<float> q = RandomTensor({20 + i, 5, kHq, kD}, &rng_, req.mutable_q());
    std::vector<float> k = RandomTensor({20 + i, kHkv, kD}, &rng_, req.mutable_k());
    std::vector<float> v = RandomTensor({20 + i, kHkv, kD}, &rng_, req.mutable_v());
    grpc::ClientContext ctx;
    v1::PrefillResponse resp;
    ASSERT_TRUE(stub_->Prefill(&ctx, req, &resp).ok());
    ASSERT_TRUE(refs[i].Prefill(0, q, k, v, 20 + i).ok());
  }
  // Fills `req` with a packed step for both sequences; returns each row's reference output.
  const auto step = [&](v1::DecodeRequest* req) {
    req->set_layer(0);
    for (const std::string& id : ids) req->add_sequence_ids(id);
    std::vector<float> q = RandomTensor({2, 5, kHq, kD}, &rng_, req->mutable_q());
    std::vector<float> k = RandomTensor({2, kHkv, kD}, &rng_, req->mutable_k());
    std::vector<float> v = RandomTensor({2, kHkv, kD}, &rng_, req->mutable_v());
    std::vector<float> want;
    for (int i = 0; i < 2; ++i) {
      const int64_t q_row = 5 * kHq * kD, kv_row = kHkv * kD;
      absl::StatusOr<std::vector<float>> o =
          refs[i].Decode(0, std::vector<float>(q.begin() + i * q_row, q.begin() + (i + 1) * q_row),
                         std::vector<float>(k.begin() + i * kv_row, k.begin() + (i + 1) * kv_row),
                         std::vector<float>(v.begin() + i * kv_row, v.begin() + (i + 1) * kv_row));
      EXPECT_TRUE(o.ok());
      if (o.ok()) want.insert(want.end(), o->begin(), o->end());
    }
    return want;
  };
  {
    v1::DecodeRequest req;
    std::vector<float> want = step(&req);
    grpc::ClientContext ctx;
    v1::DecodeResponse resp;
    grpc::Status s = stub_->Decode(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.outputs_size(), 0);
    EXPECT_EQ(std::vector<int64_t>(resp.lengths().begin(), resp.lengths().end()),
              (std::vector<int64_t>{21, 22}));
    ExpectMatches(resp.o(), {2, kHq, kD}, want, "packed decode");
  }
  {
    v1::DecodeRequest bad;
    bad.set_layer(0);
    for (const std::string& id : ids) bad.add_sequence_ids(id);
    RandomTensor({2, 5, kHq, kD}, &rng_, bad.mutable_q());
    RandomTensor({2, kHkv, kD}, &rng_, bad.mutable_k());
    RandomTensor({1, kHkv, kD}, &rng_, bad.mutable_v());
    grpc::ClientContext ctx;
    v1::DecodeResponse resp;
    grpc::Status s = stub_->Decode(&ctx, bad, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(s.error_message(),
              "packed v: shape must be [2, 2, 64] (one row per sequence_id, 2 sequence_ids), got "
              "[1, 2, 64]");
  }
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream =
      stub_->Session(&ctx);
  v1::SessionRequest req;
  req.set_tag(5);
  std::vector<float> want = step(req.mutable_decode());
  ASSERT_TRUE(stream->Write(req));
  v1::SessionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.code(), 0) << resp.message();
  ASSERT_TRUE(resp.has_decode());
  // The refused request changed nothing: one more token each.
  EXPECT_EQ(std::vector<int64_t>(resp.decode().lengths().begin(), resp.decode().lengths().end()),
            (std::vector<int64_t>{22, 23}));
  ExpectMatches(resp.decode().o(), {2, kHq, kD}, want, "packed decode in a session");
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServiceTest, MessagesPastTheLimitAreResourceExhausted) {
  const std::string id = Create();
  v1::PrefillRequest req;
  req.set_sequence_id(id);
  RandomTensor({300, 5, kHq, kD}, &rng_, req.mutable_q());  // 1.5 MB of q alone
  RandomTensor({300, kHkv, kD}, &rng_, req.mutable_k());
  RandomTensor({300, kHkv, kD}, &rng_, req.mutable_v());
  grpc::ClientContext ctx;
  v1::PrefillResponse resp;
  EXPECT_EQ(stub_->Prefill(&ctx, req, &resp).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

TEST_F(ServiceTest, SessionAnswersInOrderAndSurvivesAFailedRequest) {
  const std::string id = Create();
  naive::NaiveSequence ref(TinyGeometry(), 2);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream =
      stub_->Session(&ctx);

  v1::SessionRequest prefill;
  prefill.set_tag(11);
  prefill.mutable_prefill()->set_sequence_id(id);
  prefill.mutable_prefill()->set_layer(1);
  std::vector<float> q =
      RandomTensor({20, 5, kHq, kD}, &rng_, prefill.mutable_prefill()->mutable_q());
  std::vector<float> k =
      RandomTensor({20, kHkv, kD}, &rng_, prefill.mutable_prefill()->mutable_k());
  std::vector<float> v =
      RandomTensor({20, kHkv, kD}, &rng_, prefill.mutable_prefill()->mutable_v());
  ASSERT_TRUE(stream->Write(prefill));
  v1::SessionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.tag(), 11u);
  EXPECT_EQ(resp.code(), 0);
  EXPECT_EQ(resp.message(), "");
  ASSERT_TRUE(resp.has_prefill());
  EXPECT_EQ(resp.prefill().length(), 20);
  absl::StatusOr<std::vector<float>> want = ref.Prefill(1, q, k, v, 20);
  ASSERT_TRUE(want.ok());
  ExpectMatches(resp.prefill().o(), {20, kHq, kD}, *want, "session prefill");

  // A failing decode (bad layer), then an empty request: both answered, the stream goes on.
  v1::SessionRequest bad;
  bad.set_tag(12);
  bad.mutable_decode()->set_layer(7);
  v1::DecodeEntry* be = bad.mutable_decode()->add_entries();
  be->set_sequence_id(id);
  RandomTensor({3, kHq, kD}, &rng_, be->mutable_q());
  RandomTensor({kHkv, kD}, &rng_, be->mutable_k());
  RandomTensor({kHkv, kD}, &rng_, be->mutable_v());
  v1::SessionRequest empty;
  empty.set_tag(13);
  v1::SessionRequest decode;
  decode.set_tag(14);
  decode.mutable_decode()->set_layer(1);
  v1::DecodeEntry* de = decode.mutable_decode()->add_entries();
  de->set_sequence_id(id);
  std::vector<float> dq = RandomTensor({5, kHq, kD}, &rng_, de->mutable_q());
  std::vector<float> dk = RandomTensor({kHkv, kD}, &rng_, de->mutable_k());
  std::vector<float> dv = RandomTensor({kHkv, kD}, &rng_, de->mutable_v());
  // Pipelined: all three written before any is read; answers must come back in this order.
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(stream->Write(empty));
  ASSERT_TRUE(stream->Write(decode));

  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.tag(), 12u);
  EXPECT_EQ(resp.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(resp.message(), "layer 7 is not in [0, 2)");
  EXPECT_EQ(resp.response_case(), v1::SessionResponse::RESPONSE_NOT_SET);

  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.tag(), 13u);
  EXPECT_EQ(resp.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(resp.message(), "a session request must hold a prefill or a decode request");

  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.tag(), 14u);
  EXPECT_EQ(resp.code(), 0);
  ASSERT_TRUE(resp.has_decode());
  ASSERT_EQ(resp.decode().outputs_size(), 1);
  EXPECT_EQ(resp.decode().outputs(0).length(), 21);
  want = ref.Decode(1, dq, dk, dv);
  ASSERT_TRUE(want.ok());
  ExpectMatches(resp.decode().outputs(0).o(), {kHq, kD}, *want, "session decode");

  ASSERT_TRUE(stream->WritesDone());
  EXPECT_FALSE(stream->Read(&resp));
  grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// A fleet member (--instance-name): GetServerInfo names it, its ids carry the name, and every
// transport answers a call for another instance's sequence FAILED_PRECONDITION naming the owner.
TEST(FleetMemberServiceTest, AnotherInstancesSequenceIsFailedPreconditionOnEveryCall) {
  ServerOptions options = TinyOptions();
  options.instance_name = "attnd-a";
  options.advertise_address = "attnd-a.attnd-headless.default.svc:50051";
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::Attention::Stub> stub = v1::Attention::NewStub(channel);
  std::mt19937 rng(5);

  {
    grpc::ClientContext ctx;
    v1::GetServerInfoResponse info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    EXPECT_EQ(info.instance().name(), "attnd-a");
    EXPECT_EQ(info.instance().advertise_address(), "attnd-a.attnd-headless.default.svc:50051");
  }
  std::string own;
  {
    grpc::ClientContext ctx;
    v1::CreateSequenceResponse resp;
    ASSERT_TRUE(stub->CreateSequence(&ctx, v1::CreateSequenceRequest(), &resp).ok());
    own = resp.sequence_id();
  }
  ASSERT_EQ(own.size(), 8u + 32u) << own;
  EXPECT_EQ(own.substr(0, 8), "attnd-a.");

  const std::string foreign = "attnd-b.00112233445566778899aabbccddeeff";
  const std::string owned_by_b =
      "sequence attnd-b.00112233445566778899aabbccddeeff is owned by attnd instance \"attnd-b\" "
      "(this is \"attnd-a\"); send calls for it to that instance";
  auto prefill_of = [&](const std::string& id, v1::PrefillRequest* req) {
    req->set_sequence_id(id);
    RandomTensor({2, 5, kHq, kD}, &rng, req->mutable_q());
    RandomTensor({2, kHkv, kD}, &rng, req->mutable_k());
    RandomTensor({2, kHkv, kD}, &rng, req->mutable_v());
  };
  {  // Unary Prefill (the wire fast path parses this one).
    v1::PrefillRequest req;
    prefill_of(own, &req);
    grpc::ClientContext ctx;
    v1::PrefillResponse resp;
    ASSERT_TRUE(stub->Prefill(&ctx, req, &resp).ok());
    prefill_of(foreign, &req);
    grpc::ClientContext ctx2;
    grpc::Status s = stub->Prefill(&ctx2, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(s.error_message(), owned_by_b);
  }
  {  // A batched Decode: the first foreign entry is named; nothing is applied.
    v1::DecodeRequest req;
    req.set_layer(0);
    for (const std::string& id : {own, foreign, std::string("attnd-c.") + std::string(32, '0')}) {
      v1::DecodeEntry* e = req.add_entries();
      e->set_sequence_id(id);
      RandomTensor({3, kHq, kD}, &rng, e->mutable_q());
      RandomTensor({kHkv, kD}, &rng, e->mutable_k());
      RandomTensor({kHkv, kD}, &rng, e->mutable_v());
    }
    grpc::ClientContext ctx;
    v1::DecodeResponse resp;
    grpc::Status s = stub->Decode(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(s.error_message(), absl::StrCat("entries[1]: ", owned_by_b));
  }
  {  // ReleaseSequence, and the Admin service's release.
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(foreign);
    grpc::ClientContext ctx;
    v1::ReleaseSequenceResponse resp;
    grpc::Status s = stub->ReleaseSequence(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(s.error_message(), owned_by_b);
    std::unique_ptr<v1::Admin::Stub> admin = v1::Admin::NewStub(channel);
    v1::AdminReleaseSequenceRequest areq;
    areq.set_sequence_id(foreign);
    grpc::ClientContext actx;
    v1::AdminReleaseSequenceResponse aresp;
    s = admin->ReleaseSequence(&actx, areq, &aresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(s.error_message(), owned_by_b);
  }
  {  // A Session: the request fails, the stream goes on.
    grpc::ClientContext ctx;
    auto stream = stub->Session(&ctx);
    v1::SessionRequest req;
    req.set_tag(1);
    prefill_of(foreign, req.mutable_prefill());
    ASSERT_TRUE(stream->Write(req));
    v1::SessionResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_EQ(resp.tag(), 1u);
    EXPECT_EQ(resp.code(), static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
    EXPECT_EQ(resp.message(), owned_by_b);
    req.set_tag(2);
    prefill_of(own, req.mutable_prefill());
    ASSERT_TRUE(stream->Write(req));
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_EQ(resp.code(), 0) << resp.message();
    EXPECT_EQ(resp.prefill().length(), 4);
    ASSERT_TRUE(stream->WritesDone());
    EXPECT_FALSE(stream->Read(&resp));
    EXPECT_TRUE(stream->Finish().ok());
  }
  (*server)->Shutdown(absl::Now() + absl::Seconds(5));
  (*server)->Wait();
}

TEST(FleetMemberServiceTest, ABadInstanceNameFailsStartUp) {
  ServerOptions options = TinyOptions();
  options.instance_name = "attnd_0";
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.status().message(),
            "the instance name must be a DNS label: 1 to 63 characters of a-z, 0-9 and '-', not "
            "starting or ending with '-' (e.g. a StatefulSet pod name), got \"attnd_0\" (7 "
            "characters)");
}

// An idle Session must not hold the drain until its deadline: it ends with UNAVAILABLE at once.
TEST_F(ServiceTest, ShutdownEndsIdleSessionsPromptly) {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream =
      stub_->Session(&ctx);
  // Make sure the stream is established on the server before shutting down.
  v1::SessionRequest empty;
  empty.set_tag(1);
  ASSERT_TRUE(stream->Write(empty));
  v1::SessionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.tag(), 1u);

  const auto start = std::chrono::steady_clock::now();
  server_->Shutdown(absl::Now() + absl::Seconds(30));
  server_->Wait();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0);
  EXPECT_FALSE(stream->Read(&resp));
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(s.error_message(), "the server is shutting down");
  server_.reset();
}

}  // namespace
}  // namespace attnd
