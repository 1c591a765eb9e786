#include "client/host_tensor.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace client {
namespace {

using ::testing::HasSubstr;

TEST(HostTensorTest, Fp32RoundTripIsExact) {
  const std::vector<float> values = {1.f, -2.5f, 3.1415926f, 1e-30f, -0.f, 65504.f};
  HostTensor t = HostTensor::FromFloats(DType::kFp32, {2, 3}, values);
  EXPECT_EQ(t.data.size(), 24u);
  EXPECT_EQ(t.num_elements(), 6);
  EXPECT_TRUE(t.Validate().ok());
  EXPECT_EQ(t.ToFloats(), values);
}

TEST(HostTensorTest, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between two bf16 values (7 mantissa bits): ties to even (1.0).
  // 1 + 3*2^-8 is halfway between 1+2^-7 and 1+2^-6: ties to even (1 + 2^-6).
  const std::vector<float> values = {1.f + std::ldexp(1.f, -8), 1.f + 3 * std::ldexp(1.f, -8),
                                     -3.f};
  HostTensor t = HostTensor::FromFloats(DType::kBf16, {3}, values);
  ASSERT_EQ(t.data.size(), 6u);
  const std::vector<float> back = t.ToFloats();
  EXPECT_EQ(back[0], 1.f);
  EXPECT_EQ(back[1], 1.f + std::ldexp(1.f, -6));
  EXPECT_EQ(back[2], -3.f);
  // Raw bits of -3.0 in bf16: sign 1, exponent 128, mantissa 0x40 -> 0xC040, little-endian.
  EXPECT_EQ(static_cast<unsigned char>(t.data[4]), 0x40);
  EXPECT_EQ(static_cast<unsigned char>(t.data[5]), 0xC0);
}

TEST(HostTensorTest, Fp16KeepsElevenBits) {
  const std::vector<float> values = {1.f + std::ldexp(1.f, -10), 0.1f};
  HostTensor t = HostTensor::FromFloats(DType::kFp16, {2}, values);
  const std::vector<float> back = t.ToFloats();
  EXPECT_EQ(back[0], values[0]);  // representable in fp16
  EXPECT_NEAR(back[1], 0.1f, 0.1f * std::ldexp(1.f, -11));
  EXPECT_NE(back[1], 0.1f);
}

TEST(HostTensorTest, ValidateRejectsByteCountMismatch) {
  HostTensor t = HostTensor::FromBytes(DType::kBf16, {2, 3}, std::string(10, '\0'));
  absl::Status s = t.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("needs 12 bytes, has 10"));
}

TEST(HostTensorTest, ProtoRoundTrip) {
  HostTensor t = HostTensor::FromFloats(DType::kBf16, {1, 2}, std::vector<float>{0.5f, 2.f});
  v1::Tensor proto;
  ToProto(t, &proto);
  EXPECT_EQ(proto.dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(proto.shape(), ::testing::ElementsAre(1, 2));
  absl::StatusOr<HostTensor> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ToFloats(), (std::vector<float>{0.5f, 2.f}));

  proto.set_dtype(v1::DTYPE_UNSPECIFIED);
  absl::StatusOr<HostTensor> bad = FromProto(proto);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("DTYPE_UNSPECIFIED"));

  proto.set_dtype(v1::DTYPE_FP32);  // 4 bytes of data for 2 fp32 elements
  bad = FromProto(proto);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("needs 8 bytes, has 4"));
}

TEST(HostTensorTest, ParseDType) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBf16);
  EXPECT_EQ(*ParseDType("fp16"), DType::kFp16);
  EXPECT_EQ(*ParseDType("fp32"), DType::kFp32);
  absl::StatusOr<DType> bad = ParseDType("int8");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("unknown dtype \"int8\""));
}

}  // namespace
}  // namespace client
}  // namespace attnd
