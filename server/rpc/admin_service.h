// attnd.v1.Admin (proto/attnd/v1/admin.proto): list every tenant's sequences and release any of
// them, for operators (attnctl sequences / release).
//
// Who may call it (AdminAccess): with tokens, only calls whose token belongs to the admin tenant
// (--admin-tenant); with tokens off, only peers on a loopback address. Everyone else gets
// PERMISSION_DENIED saying which tenant (or which peer) is needed. The work runs on the work queue
// (a release may wait for a busy sequence's request), never on gRPC's threads.
#ifndef ATTND_SERVER_RPC_ADMIN_SERVICE_H_
#define ATTND_SERVER_RPC_ADMIN_SERVICE_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "attnd/v1/admin.grpc.pb.h"
#include "server/rpc/auth.h"
#include "server/runtime/runtime.h"
#include "server/sched/work_queue.h"

namespace attnd {

// OK when the call may use the Admin service. `tokens` null: auth is off, and `peer` (gRPC's
// "ipv4:127.0.0.1:1234", "ipv6:[::1]:1234", "unix:...") must be loopback. Otherwise `tenant`
// (the call's, from TenantOf) must equal `admin_tenant`, which "" turns the service off.
absl::Status AdminAccess(const TokenStore* tokens, absl::string_view admin_tenant,
                         absl::string_view tenant, absl::string_view peer);

// Whether gRPC's peer string names a loopback address or a unix socket.
bool IsLoopbackPeer(absl::string_view peer);

class AdminService final : public v1::Admin::CallbackService {
 public:
  // runtime and work_queue must outlive the service and its RPCs.
  AdminService(Runtime* runtime, WorkQueue* work_queue, std::shared_ptr<const TokenStore> tokens,
               std::string admin_tenant);

  grpc::ServerUnaryReactor* ListSequences(grpc::CallbackServerContext* context,
                                          const v1::AdminListSequencesRequest* request,
                                          v1::AdminListSequencesResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* context,
                                            const v1::AdminReleaseSequenceRequest* request,
                                            v1::AdminReleaseSequenceResponse* response) override;

 private:
  // The caller's access (AdminAccess on its metadata and peer).
  absl::Status Check(grpc::CallbackServerContext* context) const;

  Runtime* const runtime_;
  WorkQueue* const work_queue_;
  const std::shared_ptr<const TokenStore> tokens_;  // null: auth is off
  const std::string admin_tenant_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_ADMIN_SERVICE_H_
