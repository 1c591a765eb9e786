#include "client/host_tensor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnd {
namespace client {

HostTensor HostTensor::FromFloats(DType dtype, std::vector<int64_t> shape,
                                  absl::Span<const float> values) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(values.size() * ElementSize(dtype));
  ConvertFromFloat(values.data(), values.size(), dtype, t.data.data());
  return t;
}

HostTensor HostTensor::FromBytes(DType dtype, std::vector<int64_t> shape, std::string data) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = std::move(data);
  return t;
}

int64_t HostTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> HostTensor::ToFloats() const {
  const size_t n = data.size() / ElementSize(dtype);
  std::vector<float> out(n);
  ConvertToFloat(data.data(), dtype, n, out.data());
  return out;
}

absl::Status HostTensor::Validate() const {
  for (int64_t d : shape) {
    if (d < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension in shape [", absl::StrJoin(shape, ", "), "]"));
  }
  const int64_t want = num_elements() * static_cast<int64_t>(ElementSize(dtype));
  if (static_cast<int64_t>(data.size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat("tensor of shape [", absl::StrJoin(shape, ", "),
                                                   "] and dtype ", DTypeName(dtype), " needs ",
                                                   want, " bytes, has ", data.size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "bf16") return DType::kBf16;
  if (name == "fp16") return DType::kFp16;
  if (name == "fp32") return DType::kFp32;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype \"", name, "\"; expected bf16, fp16 or fp32"));
}

v1::DType ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return v1::DTYPE_BF16;
    case DType::kFp16:
      return v1::DTYPE_FP16;
    case DType::kFp32:
      return v1::DTYPE_FP32;
    case DType::kFp8E4m3:  // KV cache dtypes: named in GetServerInfo, never a request tensor's
      return v1::DTYPE_FP8_E4M3;
    case DType::kInt8:
      return v1::DTYPE_INT8;
  }
  return v1::DTYPE_UNSPECIFIED;
}

void ToProto(const HostTensor& tensor, v1::Tensor* proto) {
  proto->set_dtype(ToProtoDType(tensor.dtype));
  proto->mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
  proto->set_data(tensor.data);
}

namespace {

// t's dtype and shape from `proto` (its bytes are the caller's business).
absl::Status SetMeta(const v1::Tensor& proto, HostTensor* t) {
  switch (proto.dtype()) {
    case v1::DTYPE_BF16:
      t->dtype = DType::kBf16;
      break;
    case v1::DTYPE_FP16:
      t->dtype = DType::kFp16;
      break;
    case v1::DTYPE_FP32:
      t->dtype = DType::kFp32;
      break;
    default:
      return absl::InternalError(
          absl::StrCat("server returned a tensor with dtype ", v1::DType_Name(proto.dtype())));
  }
  t->shape.assign(proto.shape().begin(), proto.shape().end());
  return absl::OkStatus();
}

// FromProto with the bytes already in `t.data`.
absl::StatusOr<HostTensor> FromProtoMeta(const v1::Tensor& proto, HostTensor t) {
  if (absl::Status s = SetMeta(proto, &t); !s.ok()) return s;
  absl::Status valid = t.Validate();
  if (!valid.ok()) {
    return absl::InternalError(
        absl::StrCat("server returned a malformed tensor: ", valid.message()));
  }
  return t;
}

}  // namespace

absl::StatusOr<HostTensor> MetaFromProto(const v1::Tensor& proto) {
  HostTensor t;
  if (absl::Status s = SetMeta(proto, &t); !s.ok()) return s;
  return t;
}

absl::StatusOr<HostTensor> FromProto(const v1::Tensor& proto) {
  HostTensor t;
  t.data = proto.data();
  return FromProtoMeta(proto, std::move(t));
}

absl::StatusOr<HostTensor> FromProto(v1::Tensor&& proto) {
  HostTensor t;
  t.data = std::move(*proto.mutable_data());
  return FromProtoMeta(proto, std::move(t));
}

}  // namespace client
}  // namespace attnd
