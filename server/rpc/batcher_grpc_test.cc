// The decode batcher over loopback gRPC: AttndServer with batching on, concurrent clients, an
// expired call. batcher_test covers the batcher alone and through the real Runtime; both run
// under ThreadSanitizer, this one linked against the TSan builds of gRPC, protobuf and abseil that
// script/tsan-deps makes (docs/RELIABILITY.md, "Sanitizers").
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "base/mutex.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/testing/naive_dca.h"
#include "server/config/model_config.h"
#include "server/config/test_models.h"
#include "server/rpc/server.h"

namespace attnd {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 64;  // configs/tiny

using test_models::RandomFloats;
using test_models::TinyModel;

ServerOptions TinyServerOptions(int clients) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.model_config = "configs/tiny/config.json";
  o.device = "cpu";
  o.kv_cache_bytes = 128 * 32768;
  o.max_message_bytes = 1 << 22;
  o.max_sequence_length = 1024;
  o.compute_threads = 2;
  o.request_workers = 4;
  // A batch launches only once every client's call is in (the one captured size is the client
  // count and the delay is far longer than the test), so the batches do not depend on timing.
  o.max_decode_batch = clients;
  o.max_queue_delay_us = 60'000'000;
  o.cuda_graph_batch_sizes = absl::StrCat(clients);
  return o;
}

std::vector<float> FillTensor(std::vector<int64_t> shape, std::mt19937* rng, v1::Tensor* t) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values = RandomFloats(n, rng);
  t->set_dtype(v1::DTYPE_FP32);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  t->set_data(values.data(), values.size() * sizeof(float));
  return values;
}

v1::DecodeBatchingStats ServerStats(v1::Attention::Stub* stub) {
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  EXPECT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  return info.decode_batching();
}

// N clients, each on its own channel and sequence, send batch-1 decodes back to back: every
// batch holds one call of each client, every output matches the fp64 reference, and
// GetServerInfo reports exactly those merged batches.
TEST(BatchingGrpcTest, ConcurrentBatchOneClientsAreMergedAndCorrect) {
  constexpr int kClients = 6, kRounds = 5;
  absl::StatusOr<std::unique_ptr<AttndServer>> server =
      AttndServer::Start(TinyServerOptions(kClients));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = absl::StrCat("127.0.0.1:", (*server)->port());
  std::vector<std::string> failures(kClients);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      grpc::ChannelArguments args;
      args.SetInt("attnd.test.client", c);  // a connection of its own
      auto stub = v1::Attention::NewStub(
          grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
      std::mt19937 rng(100 + c);
      naive::NaiveSequence ref(TinyModel().geometry(), 2);
      grpc::ClientContext create_ctx;
      v1::CreateSequenceResponse created;
      grpc::Status s = stub->CreateSequence(&create_ctx, {}, &created);
      if (!s.ok()) return void(failures[c] = "create: " + s.error_message());
      const int64_t prompt = 40 + 29 * c;  // crosses the chunk length (128) for some clients
      v1::PrefillRequest pre;
      pre.set_sequence_id(created.sequence_id());
      std::vector<float> q = FillTensor({prompt, 5, kHq, kD}, &rng, pre.mutable_q());
      std::vector<float> k = FillTensor({prompt, kHkv, kD}, &rng, pre.mutable_k());
      std::vector<float> v = FillTensor({prompt, kHkv, kD}, &rng, pre.mutable_v());
      if (!ref.Prefill(0, q, k, v, prompt).ok()) return void(failures[c] = "reference prefill");
      grpc::ClientContext pre_ctx;
      v1::PrefillResponse pre_resp;
      s = stub->Prefill(&pre_ctx, pre, &pre_resp);
      if (!s.ok()) return void(failures[c] = "prefill: " + s.error_message());
      for (int r = 0; r < kRounds; ++r) {
        v1::DecodeRequest req;
        v1::DecodeEntry* e = req.add_entries();
        e->set_sequence_id(created.sequence_id());
        std::vector<float> dq = FillTensor({3, kHq, kD}, &rng, e->mutable_q());
        std::vector<float> dk = FillTensor({kHkv, kD}, &rng, e->mutable_k());
        std::vector<float> dv = FillTensor({kHkv, kD}, &rng, e->mutable_v());
        grpc::ClientContext ctx;
        v1::DecodeResponse resp;
        s = stub->Decode(&ctx, req, &resp);
        if (!s.ok()) return void(failures[c] = absl::StrCat("decode ", r, ": ", s.error_message()));
        absl::StatusOr<std::vector<float>> want = ref.Decode(0, dq, dk, dv);
        if (!want.ok() || resp.outputs_size() != 1 || resp.outputs(0).length() != prompt + r + 1 ||
            resp.outputs(0).o().data().size() != want->size() * sizeof(float)) {
          return void(failures[c] = absl::StrCat("decode ", r, ": wrong length or size"));
        }
        const float* got = reinterpret_cast<const float*>(resp.outputs(0).o().data().data());
        for (size_t j = 0; j < want->size(); ++j) {
          if (std::abs(got[j] - (*want)[j]) > 2e-5 + 2e-5 * std::abs((*want)[j])) {
            return void(failures[c] = absl::StrCat("decode ", r, " element ", j, ": ", got[j],
                                                   " vs ", (*want)[j]));
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int c = 0; c < kClients; ++c) EXPECT_EQ(failures[c], "") << "client " << c;

  auto stub =
      v1::Attention::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  const v1::DecodeBatchingStats st = ServerStats(stub.get());
  EXPECT_TRUE(st.enabled());
  EXPECT_EQ(st.max_decode_batch(), kClients);
  EXPECT_EQ(st.batches(), kRounds);
  EXPECT_EQ(st.entries(), kClients * kRounds);
  ASSERT_EQ(st.batches_by_size_size(), 1);
  EXPECT_EQ(st.batches_by_size(0).size(), kClients);
  EXPECT_EQ(st.batches_by_size(0).batches(), kRounds);
  EXPECT_EQ(st.calls_completed(), kClients * kRounds);
  EXPECT_EQ(st.eager_launches(), kRounds);
  EXPECT_EQ(st.graph_replays(), 0);
  EXPECT_EQ(st.padding_entries(), 0);
  int64_t delays = 0;
  for (int64_t n : st.queue_delay_count()) delays += n;
  EXPECT_EQ(delays, kClients * kRounds);
  (*server)->Shutdown(absl::Now() + absl::Seconds(5));
  (*server)->Wait();
}

// A decode whose RPC deadline passes while it waits for a batch is dropped by the server without
// touching the sequence: its next decode still gets length prompt + 1.
TEST(BatchingGrpcTest, AnExpiredDecodeIsDroppedWithoutChangingTheSequence) {
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(TinyServerOptions(2));
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Attention::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials()));
  std::mt19937 rng(5);
  grpc::ClientContext create_ctx;
  v1::CreateSequenceResponse created;
  ASSERT_TRUE(stub->CreateSequence(&create_ctx, {}, &created).ok());
  v1::PrefillRequest pre;
  pre.set_sequence_id(created.sequence_id());
  FillTensor({10, 5, kHq, kD}, &rng, pre.mutable_q());
  FillTensor({10, kHkv, kD}, &rng, pre.mutable_k());
  FillTensor({10, kHkv, kD}, &rng, pre.mutable_v());
  grpc::ClientContext pre_ctx;
  v1::PrefillResponse pre_resp;
  ASSERT_TRUE(stub->Prefill(&pre_ctx, pre, &pre_resp).ok());
  v1::DecodeRequest req;
  v1::DecodeEntry* e = req.add_entries();
  e->set_sequence_id(created.sequence_id());
  FillTensor({3, kHq, kD}, &rng, e->mutable_q());
  FillTensor({kHkv, kD}, &rng, e->mutable_k());
  FillTensor({kHkv, kD}, &rng, e->mutable_v());
  {
    // Alone, it can never fill the batch of 2: it waits until its deadline.
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    v1::DecodeResponse resp;
    EXPECT_EQ(stub->Decode(&ctx, req, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // The server drops it at the deadline (or when it sees the cancellation); wait for that.
  for (int i = 0; i < 3000; ++i) {
    const v1::DecodeBatchingStats st = ServerStats(stub.get());
    if (st.calls_deadline_exceeded() + st.calls_cancelled() == 1) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  v1::DecodeBatchingStats st = ServerStats(stub.get());
  EXPECT_EQ(st.calls_deadline_exceeded() + st.calls_cancelled(), 1);
  EXPECT_EQ(st.batches(), 0);
  EXPECT_EQ(st.queued_calls(), 0);
  // Shutdown flushes a lone queued call at once (it does not wait for the 60 s delay).
  v1::DecodeResponse resp;
  grpc::ClientContext ctx;
  Notification answered;
  grpc::Status status;
  stub->async()->Decode(&ctx, &req, &resp, [&](grpc::Status s) {
    status = std::move(s);
    answered.Notify();
  });
  for (int i = 0; i < 3000 && ServerStats(stub.get()).queued_calls() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  (*server)->Shutdown(absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(resp.outputs_size(), 1);
  EXPECT_EQ(resp.outputs(0).length(), 11);  // the expired decode changed nothing
  (*server)->Wait();
}

}  // namespace
}  // namespace attnd
