// A dense row-major tensor held in host memory, as the client sends and receives it: a dtype, a
// shape and the raw little-endian bytes. Conversions go through base/dtype.h so the client
// rounds exactly as the server does.
#ifndef ATTND_CLIENT_HOST_TENSOR_H_
#define ATTND_CLIENT_HOST_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnd/v1/attention.pb.h"
#include "base/dtype.h"

namespace attnd {
namespace client {

struct HostTensor {
  DType dtype = DType::kFp32;
  std::vector<int64_t> shape;
  std::string data;  // product(shape) * ElementSize(dtype) bytes, little-endian, row-major

  // Rounds `values` (product(shape) of them) to `dtype`.
  static HostTensor FromFloats(DType dtype, std::vector<int64_t> shape,
                               absl::Span<const float> values);
  // From raw bytes already in `dtype`; the byte count is not checked here, so tests can build
  // malformed tensors on purpose.
  static HostTensor FromBytes(DType dtype, std::vector<int64_t> shape, std::string data);

  int64_t num_elements() const;
  // The elements widened to fp32 (exact for every dtype). Requires a well-formed tensor.
  std::vector<float> ToFloats() const;
  // INVALID_ARGUMENT when data's size does not match dtype and shape.
  absl::Status Validate() const;
};

// Parses "bf16" | "fp16" | "fp32".
absl::StatusOr<DType> ParseDType(absl::string_view name);

// proto <-> host. FromProto rejects DTYPE_UNSPECIFIED and byte counts that do not match the shape
// (a server bug if it ever happens, so callers see INTERNAL rather than garbage).
void ToProto(const HostTensor& tensor, v1::Tensor* proto);
absl::StatusOr<HostTensor> FromProto(const v1::Tensor& proto);
// The same, moving the bytes out of `proto` instead of copying them.
absl::StatusOr<HostTensor> FromProto(v1::Tensor&& proto);
// Only the dtype and shape, no bytes: an output the server wrote into a region.
absl::StatusOr<HostTensor> MetaFromProto(const v1::Tensor& proto);
v1::DType ToProtoDType(DType dtype);

}  // namespace client
}  // namespace attnd

#endif  // ATTND_CLIENT_HOST_TENSOR_H_
