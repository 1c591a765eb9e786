// libFuzzer target: server/rpc/wire.h's hand parser of PrefillRequest against protobuf's. Input:
// byte 0 seeds how the rest is cut into slices (as gRPC hands a message over), the rest is the
// message. Whenever the hand parser accepts bytes, protobuf must parse them to the same fields;
// whatever protobuf rejects, the hand parser must decline.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "attnd/v1/attention.pb.h"
#include "server/rpc/wire.h"

namespace {

namespace v1 = attnd::v1;
using attnd::wire::WirePrefillRequest;
using attnd::wire::WireTensor;

#define WIRE_CHECK(cond, what)                                               \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "wire_fuzz: %s disagrees with protobuf\n", what); \
      std::abort();                                                          \
    }                                                                        \
  } while (0)

void Same(const v1::Tensor& want, const WireTensor& got) {
  WIRE_CHECK(want.dtype() == got.dtype, "dtype");
  WIRE_CHECK(std::vector<int64_t>(want.shape().begin(), want.shape().end()) == got.shape, "shape");
  WIRE_CHECK(want.data() == got.bytes, "data");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static std::shared_ptr<attnd::wire::BufferPool> pool =
      std::make_shared<attnd::wire::BufferPool>(16 << 20);
  if (size < 1) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  // Cuts every `step` bytes (1..8, or none).
  const size_t step = data[0] % 9;
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size();) {
    const size_t n = step == 0 ? bytes.size() : std::min(step, bytes.size() - at);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  const grpc::ByteBuffer in(slices.data(), slices.size());
  v1::PrefillRequest proto;
  const bool proto_ok = proto.ParseFromString(bytes);
  WirePrefillRequest got;
  if (!attnd::wire::ParsePrefillRequest(in, pool.get(), &got)) return 0;
  WIRE_CHECK(proto_ok, "acceptance");
  WIRE_CHECK(proto.sequence_id() == got.sequence_id, "sequence_id");
  WIRE_CHECK(proto.layer() == got.layer, "layer");
  Same(proto.q(), got.q);
  Same(proto.k(), got.k);
  Same(proto.v(), got.v);
  WIRE_CHECK(proto.has_prompt_len() == got.prompt_len.has_value(), "prompt_len presence");
  WIRE_CHECK(!proto.has_prompt_len() || proto.prompt_len() == *got.prompt_len, "prompt_len");
  WIRE_CHECK(static_cast<int>(proto.q_layout()) == got.q_layout, "q_layout");
  return 0;
}
