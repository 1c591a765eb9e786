// grpc.health.v1.Health (Check and Watch) for the API port, in place of gRPC's default service:
// gRPC 1.51's default keeps Watch streams open through its Shutdown(), so one probe's Watch held a
// drain for the whole --drain-timeout (issue #13). Here Shutdown() sends NOT_SERVING to every
// watcher and ends its stream.
#ifndef ATTND_SERVER_RPC_HEALTH_SERVICE_H_
#define ATTND_SERVER_RPC_HEALTH_SERVICE_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "base/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attnd {

class HealthWatch;

// Thread-safe. Must outlive the grpc::Server it is registered with (Watch streams call into it
// until they are done).
class HealthService : public grpc::health::v1::Health::CallbackService {
 public:
  // `services`: the names Check and Watch know besides "" (the server as a whole). All start
  // NOT_SERVING.
  explicit HealthService(std::vector<std::string> services);

  // Every known name (and "") to SERVING or NOT_SERVING; watchers are told. No effect after
  // Shutdown.
  void SetServing(bool serving);
  // NOT_SERVING for good; every open Watch stream gets it and then ends with OK.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

 private:
  friend class HealthWatch;
  using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;
  Status StatusOfLocked(const std::string& service) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unregister(HealthWatch* watch);

  mutable Mutex mu_;
  absl::flat_hash_set<std::string> services_ ABSL_GUARDED_BY(mu_);
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<HealthWatch*> watches_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_HEALTH_SERVICE_H_
