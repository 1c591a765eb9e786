// EncodePrefillRequest against protobuf's serializer of the request AttndClient used to build.
#include "client/prefill_wire.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace attnd {
namespace client {
namespace {

std::string Bytes(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

HostTensor Random(DType dtype, std::vector<int64_t> shape, size_t bytes, std::mt19937* rng) {
  std::string data(bytes, '\0');
  for (char& c : data) c = static_cast<char>((*rng)() & 0xff);
  return HostTensor::FromBytes(dtype, std::move(shape), std::move(data));
}

TEST(PrefillWire, ByteForByteWhatProtobufSerializes) {
  auto buffers = std::make_shared<SendBuffers>();
  std::mt19937 rng(7);
  struct Case {
    std::string id;
    int32_t layer;
    int64_t t;
    std::optional<int64_t> prompt_len;
    v1::QLayout layout;
  };
  const std::vector<Case> cases = {
      {"0123456789abcdef0123456789abcdef", 3, 100, 4096, v1::Q_LAYOUT_VARIANTS},
      {"0123456789abcdef0123456789abcdef", 0, 1, std::nullopt, v1::Q_LAYOUT_PRE_ROTARY},
      {"", -1, 0, 0, v1::Q_LAYOUT_VARIANTS},
      {"x", 27, 300, -5, static_cast<v1::QLayout>(9)},
  };
  for (const Case& c : cases) {
    const HostTensor q = Random(DType::kBf16, {c.t, 5, 28, 128}, c.t * 5 * 28 * 128 * 2, &rng);
    const HostTensor k = Random(DType::kFp32, {c.t, 4, 128}, c.t * 4 * 128 * 4, &rng);
    const HostTensor v = Random(DType::kFp16, {c.t, -4, 128}, 0, &rng);  // shapes are not checked
    v1::PrefillRequest want;
    want.set_sequence_id(c.id);
    want.set_layer(c.layer);
    ToProto(q, want.mutable_q());
    ToProto(k, want.mutable_k());
    ToProto(v, want.mutable_v());
    if (c.prompt_len.has_value()) want.set_prompt_len(*c.prompt_len);
    if (c.layout != v1::Q_LAYOUT_VARIANTS) want.set_q_layout(c.layout);
    const grpc::ByteBuffer got =
        EncodePrefillRequest(buffers.get(), c.id, c.layer, q, k, v, c.prompt_len, c.layout);
    EXPECT_TRUE(want.SerializeAsString() == Bytes(got)) << "tokens " << c.t;
  }
}

TEST(PrefillWire, TheBufferIsReusedOnceTheRequestIsGone) {
  auto buffers = std::make_shared<SendBuffers>();
  std::mt19937 rng(8);
  const HostTensor q = Random(DType::kBf16, {64, 5, 4, 8}, 64 * 5 * 4 * 8 * 2, &rng);
  const HostTensor kv = Random(DType::kBf16, {64, 2, 8}, 64 * 2 * 8 * 2, &rng);
  std::string first;
  {
    grpc::ByteBuffer a = EncodePrefillRequest(buffers.get(), "s", 1, q, kv, kv, 64, {});
    first = Bytes(a);
    // While `a` holds the buffer, the next request gets its own.
    grpc::ByteBuffer b = EncodePrefillRequest(buffers.get(), "s", 1, q, kv, kv, 64, {});
    EXPECT_EQ(buffers->allocations(), 2);
  }
  grpc::ByteBuffer c = EncodePrefillRequest(buffers.get(), "s", 1, q, kv, kv, 64, {});
  EXPECT_EQ(buffers->allocations(), 2);
  EXPECT_TRUE(Bytes(c) == first);
}

}  // namespace
}  // namespace client
}  // namespace attnd
