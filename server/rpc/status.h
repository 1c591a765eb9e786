// The one mapping between absl::Status (used everywhere inside attnd) and grpc::Status (used only
// at the gRPC boundary in server/ and client/). Both use the google.rpc.Code numbering, so codes
// map one to one and messages pass through unchanged.
#ifndef ATTND_SERVER_RPC_STATUS_H_
#define ATTND_SERVER_RPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace attnd {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_STATUS_H_
