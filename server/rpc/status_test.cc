#include "server/rpc/status.h"

#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(StatusTest, OkMapsToOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(StatusTest, EveryCodeKeepsItsCodeAndMessage) {
  // Pairs written out by hand so a wrong cast (e.g. an off-by-one enum) would fail.
  const struct {
    absl::StatusCode absl_code;
    grpc::StatusCode grpc_code;
  } kPairs[] = {
      {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
      {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
      {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
      {absl::StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
      {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
      {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
      {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
      {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
      {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
  };
  for (const auto& pair : kPairs) {
    const grpc::Status g = ToGrpcStatus(absl::Status(pair.absl_code, "what was wrong"));
    EXPECT_EQ(g.error_code(), pair.grpc_code);
    EXPECT_EQ(g.error_message(), "what was wrong");
    const absl::Status a = FromGrpcStatus(grpc::Status(pair.grpc_code, "back"));
    EXPECT_EQ(a.code(), pair.absl_code);
    EXPECT_EQ(a.message(), "back");
  }
}

}  // namespace
}  // namespace attnd
