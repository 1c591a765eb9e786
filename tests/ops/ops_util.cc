#include "tests/ops/ops_util.h"

#include <httplib.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <future>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"

namespace attnd {
namespace ops_testing {
namespace {

void FillRandom(std::vector<int64_t> shape, std::mt19937* rng, v1::Tensor* t) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& x : values) x = dist(*rng);
  t->set_dtype(v1::DTYPE_FP32);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  t->set_data(values.data(), values.size() * sizeof(float));
}

}  // namespace

ServerOptions TinyOptions(int64_t pages) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.model_config = "configs/tiny/config.json";
  o.device = "cpu";
  o.kv_cache_bytes = pages * kPageBytes;
  o.page_size = static_cast<int32_t>(kPageSize);
  o.max_message_bytes = 64 << 20;
  o.max_sequence_length = 4096;
  o.compute_threads = 2;
  o.request_workers = 4;
  o.metrics_listen = "127.0.0.1:0";
  return o;
}

Daemon::Daemon(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (server.ok()) server_ = *std::move(server);
}

Daemon::~Daemon() {
  if (server_ == nullptr) return;
  server_->Shutdown(absl::Now() + absl::Seconds(5));
  server_->Wait();
}

std::string Daemon::target() const { return absl::StrCat("127.0.0.1:", server_->port()); }

std::shared_ptr<grpc::Channel> Daemon::Channel(
    std::shared_ptr<grpc::ChannelCredentials> creds) const {
  if (creds == nullptr) creds = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // A distinct argument gives each channel its own connection (no subchannel sharing).
  static std::atomic<int> n{0};
  args.SetInt("attnd.test.channel", n++);
  // The test certificate names 127.0.0.1 and localhost; the target is 127.0.0.1.
  return grpc::CreateCustomChannel(target(), creds, args);
}

std::unique_ptr<v1::Attention::Stub> Daemon::Stub(
    std::shared_ptr<grpc::ChannelCredentials> creds) const {
  return v1::Attention::NewStub(Channel(std::move(creds)));
}

std::string WriteTwoTenantTokenFile(const std::string& name) {
  // TEST_TMPDIR under Bazel; a run by hand writes to the system's temporary directory.
  const std::string path = absl::StrCat(::testing::TempDir(), "/", name, ".", getpid());
  std::ofstream(path) << "team-a " << kTeamAToken << "\nteam-b " << kTeamBToken << "\n";
  return path;
}

std::unique_ptr<grpc::ClientContext> Context(const std::string& token,
                                             std::chrono::milliseconds timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

grpc::Status Create(v1::Attention::Stub* stub, const std::string& token, std::string* id) {
  auto ctx = Context(token);
  v1::CreateSequenceRequest req;
  v1::CreateSequenceResponse resp;
  grpc::Status s = stub->CreateSequence(ctx.get(), req, &resp);
  *id = resp.sequence_id();
  return s;
}

std::string MustCreate(v1::Attention::Stub* stub, const std::string& token) {
  std::string id;
  grpc::Status s = Create(stub, token, &id);
  EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  EXPECT_EQ(id.size(), 32u);
  return id;
}

v1::PrefillRequest MakePrefill(const std::string& id, int32_t layer, int64_t tokens,
                               std::mt19937* rng) {
  v1::PrefillRequest r;
  r.set_sequence_id(id);
  r.set_layer(layer);
  FillRandom({tokens, 5, kHq, kD}, rng, r.mutable_q());
  FillRandom({tokens, kHkv, kD}, rng, r.mutable_k());
  FillRandom({tokens, kHkv, kD}, rng, r.mutable_v());
  return r;
}

v1::DecodeRequest MakeDecode(int32_t layer, const std::vector<std::string>& ids,
                             std::mt19937* rng) {
  v1::DecodeRequest r;
  r.set_layer(layer);
  for (const std::string& id : ids) {
    v1::DecodeEntry* e = r.add_entries();
    e->set_sequence_id(id);
    FillRandom({3, kHq, kD}, rng, e->mutable_q());
    FillRandom({kHkv, kD}, rng, e->mutable_k());
    FillRandom({kHkv, kD}, rng, e->mutable_v());
  }
  return r;
}

std::optional<std::string> HttpGet(int port, const std::string& path, int* status) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(10, 0);
  auto res = client.Get(path.c_str());
  if (!res) return std::nullopt;
  if (status != nullptr) *status = res->status;
  return res->body;
}

std::optional<double> Sample(const std::string& exposition, const std::string& series) {
  std::istringstream in(exposition);
  std::string line;
  const std::string prefix = series + " ";
  while (std::getline(in, line)) {
    if (line.compare(0, prefix.size(), prefix) == 0) {
      return std::strtod(line.c_str() + prefix.size(), nullptr);
    }
  }
  return std::nullopt;
}

double SampleOr0(const std::string& exposition, const std::string& series) {
  return Sample(exposition, series).value_or(0);
}

int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                 grpc::Status* error) {
  grpc::GenericStub generic(channel);
  // HealthCheckRequest{service = field 1}; the response's field 1 is the status enum.
  const std::string request =
      service.empty()
          ? std::string()
          : absl::StrCat("\x0a", std::string(1, static_cast<char>(service.size())), service);
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::promise<grpc::Status> done;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status s = done.get_future().get();
  if (error != nullptr) *error = s;
  if (!s.ok()) return -1;
  std::vector<grpc::Slice> slices;
  std::string body;
  if (resp.Dump(&slices).ok()) {
    for (const auto& sl : slices) body.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  if (body.size() == 2 && body[0] == '\x08') return body[1];
  return body.empty() ? 0 : -2;  // 0: UNKNOWN (the default value is not sent)
}

}  // namespace ops_testing
}  // namespace attnd
