// The C++ client library (client/attnd_client.h) end to end, on any model attnd serves (the tiny
// model in configs/tiny is enough): connect, read the geometry, create a sequence, prefill a few
// tokens into every layer, decode one more token, release the sequence.
//
//   bazel build //examples/cpp:client_example
//   bazel-bin/server/attnd --model-config configs/tiny/config.json --listen 127.0.0.1:50051 &
//   bazel-bin/examples/cpp/client_example 127.0.0.1:50051
//
// The tensors are random: a real caller sends its model's rotary-embedded q variants and K/V
// (docs/DCA.md, "Inputs per token").
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"

namespace {

using attnd::DType;
using attnd::client::HostTensor;

HostTensor Random(std::mt19937* rng, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<float> values(n);
  for (float& x : values) x = uniform(*rng);
  return HostTensor::FromFloats(DType::kBf16, std::move(shape), values);
}

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "client_example: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: client_example HOST:PORT\n");
    return 2;
  }
  auto client = attnd::client::AttndClient::Connect(argv[1]);
  if (!client.ok()) return Fail("connect", client.status());

  auto info = (*client)->Info();
  if (!info.ok()) return Fail("GetServerInfo", info.status());
  const auto& model = info->model();
  const int64_t layers = model.num_layers(), hq = model.num_q_heads(), hkv = model.num_kv_heads(),
                d = model.head_dim();
  std::printf("attnd %s on %s: model %s, %lld layers, %lld q heads, %lld kv heads, head_dim %lld\n",
              info->version().c_str(), info->backend().c_str(), model.name().c_str(),
              static_cast<long long>(layers), static_cast<long long>(hq),
              static_cast<long long>(hkv), static_cast<long long>(d));

  auto seq = (*client)->CreateSequence();
  if (!seq.ok()) return Fail("CreateSequence", seq.status());

  std::mt19937 rng(1);
  constexpr int64_t kPrompt = 8;
  for (int32_t layer = 0; layer < layers; ++layer) {
    // Prefill: the five q variants [T, 5, Hq, D] and the new keys and values [T, Hkv, D].
    auto prefill =
        (*client)->Prefill(*seq, layer, Random(&rng, {kPrompt, 5, hq, d}),
                           Random(&rng, {kPrompt, hkv, d}), Random(&rng, {kPrompt, hkv, d}));
    if (!prefill.ok()) return Fail("Prefill", prefill.status());
    std::printf("layer %d: prefilled %lld tokens, output [%lld, %lld, %lld], length %lld\n", layer,
                static_cast<long long>(kPrompt), static_cast<long long>(prefill->o.shape[0]),
                static_cast<long long>(prefill->o.shape[1]),
                static_cast<long long>(prefill->o.shape[2]),
                static_cast<long long>(prefill->length));
  }
  for (int32_t layer = 0; layer < layers; ++layer) {
    // Decode one token: q holds the first three variants [3, Hq, D] (decode needs no critical
    // ones).
    std::vector<attnd::client::DecodeInput> entries(1);
    entries[0].sequence_id = *seq;
    entries[0].q = Random(&rng, {3, hq, d});
    entries[0].k = Random(&rng, {hkv, d});
    entries[0].v = Random(&rng, {hkv, d});
    auto decode = (*client)->Decode(layer, entries);
    if (!decode.ok()) return Fail("Decode", decode.status());
    const std::vector<float> o = (*decode)[0].o.ToFloats();
    bool finite = !o.empty();
    for (float x : o) finite = finite && std::isfinite(x);
    if (!finite) return Fail("Decode", absl::InternalError("output is empty or not finite"));
    std::printf("layer %d: decoded 1 token, length %lld, o[0] = %.4f\n", layer,
                static_cast<long long>((*decode)[0].length), o[0]);
  }

  auto freed = (*client)->Release(*seq);
  if (!freed.ok()) return Fail("ReleaseSequence", freed.status());
  std::printf("released the sequence: %lld pages freed\n", static_cast<long long>(*freed));
  return 0;
}
