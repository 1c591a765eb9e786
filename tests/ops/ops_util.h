// Shared pieces of the operations tests: the tiny model's daemon started in-process on 127.0.0.1:0
// (metrics on 127.0.0.1:0 too), raw gRPC stubs with optional bearer tokens, fp32 request builders,
// a /metrics scraper and parser, a grpc.health.v1 check, and test certificates made with the
// openssl CLI (nothing is checked in).
#ifndef ATTND_TESTS_OPS_OPS_UTIL_H_
#define ATTND_TESTS_OPS_OPS_UTIL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/rpc/server.h"
#include "server/rpc/test_certs.h"

namespace attnd {
namespace ops_testing {

inline constexpr int kHq = 4, kHkv = 2, kD = 64;  // configs/tiny
inline constexpr int64_t kPageSize = 16;
inline constexpr int64_t kPageBytes = 32768;  // fp32 KV: 2 layers x K,V x 16 x 2 x 64 x 4 bytes

// configs/tiny on the CPU, `pages` KV pages, metrics on 127.0.0.1:0.
ServerOptions TinyOptions(int64_t pages = 64);

// Starts a server (fails the test on error) and stops it when destroyed.
class Daemon {
 public:
  explicit Daemon(const ServerOptions& options);
  ~Daemon();
  bool ok() const { return server_ != nullptr; }
  AttndServer& server() { return *server_; }
  std::string target() const;
  // A fresh channel (own connection) with `creds` (default: plaintext).
  std::shared_ptr<grpc::Channel> Channel(
      std::shared_ptr<grpc::ChannelCredentials> creds = nullptr) const;
  std::unique_ptr<v1::Attention::Stub> Stub(
      std::shared_ptr<grpc::ChannelCredentials> creds = nullptr) const;

 private:
  std::unique_ptr<AttndServer> server_;
};

// Two tenants' bearer tokens, and a token file naming them ("team-a", "team-b"), written under
// the test's temporary directory as `name` plus the pid; returns its path.
inline const std::string kTeamAToken = "token-of-team-a-0123456789abcdef";
inline const std::string kTeamBToken = "token-of-team-b-fedcba9876543210";
std::string WriteTwoTenantTokenFile(const std::string& name);

// Per-call context: a 30 s deadline unless given, and `authorization: Bearer <token>` if set.
std::unique_ptr<grpc::ClientContext> Context(
    const std::string& token = "", std::chrono::milliseconds timeout = std::chrono::seconds(30));

// CreateSequence; fails the test unless OK.
std::string MustCreate(v1::Attention::Stub* stub, const std::string& token = "");
grpc::Status Create(v1::Attention::Stub* stub, const std::string& token, std::string* id);

// fp32 random inputs of the tiny model.
v1::PrefillRequest MakePrefill(const std::string& id, int32_t layer, int64_t tokens,
                               std::mt19937* rng);
v1::DecodeRequest MakeDecode(int32_t layer, const std::vector<std::string>& ids, std::mt19937* rng);

// GET http://127.0.0.1:port/path; nullopt when nothing answers. Sets *status.
std::optional<std::string> HttpGet(int port, const std::string& path, int* status = nullptr);

// The value of the sample `series` (e.g. `attnd_requests_total{rpc="Prefill",code="OK"}`, exactly
// as rendered) in a Prometheus text exposition; nullopt when absent.
std::optional<double> Sample(const std::string& exposition, const std::string& series);
// Sample, or 0 when absent (a counter never recorded).
double SampleOr0(const std::string& exposition, const std::string& series);

// grpc.health.v1.Health/Check for `service` ("" = overall): 1 SERVING, 2 NOT_SERVING, or -1 with
// the call's error in *error.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                 grpc::Status* error = nullptr);

// The test certificates (server/rpc/test_certs.h).
using Certs = ::attnd::TestCerts;

}  // namespace ops_testing
}  // namespace attnd

#endif  // ATTND_TESTS_OPS_OPS_UTIL_H_
