#include "server/engine/engine_factory.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "server/engine/cuda_engine.h"

namespace attnd {
namespace {

EngineOptions Tiny() {
  EngineOptions o;
  o.geometry.num_q_heads = 4;
  o.geometry.num_kv_heads = 2;
  o.geometry.head_dim = 64;
  o.geometry.chunk_len = 128;
  o.geometry.original_max_position_embeddings = 256;
  o.geometry.softmax_scale = 0.125f;
  o.num_layers = 2;
  o.page_size = 16;
  o.kv_cache_bytes = 1 << 20;
  o.compute_threads = 1;
  return o;
}

TEST(EngineFactoryTest, CpuAndAutoBuildACpuEngineWithTheRequestedPool) {
  for (const char* device : {"cpu", "auto"}) {
    EngineOptions o = Tiny();
    o.device = device;
    absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    if (std::string(device) == "auto" && CudaBuildStatus().ok() && CudaDeviceCount() > 0) {
      EXPECT_EQ((*engine)->backend(), "cuda");  // auto prefers a usable GPU
      continue;
    }
    EXPECT_EQ((*engine)->backend(), "cpu");
    const KvLayout& layout = (*engine)->layout();
    EXPECT_EQ(layout.kv_dtype, DType::kFp32);  // auto on cpu
    // One page: 2 layers x (K + V) x 16 tokens x 2 heads x 64 x 4 bytes = 32 KiB; 1 MiB holds 32.
    EXPECT_EQ(layout.bytes_per_page(), 32768);
    EXPECT_EQ(layout.num_pages, 32);
    EXPECT_EQ((*engine)->geometry().chunk_len, 128);
  }
}

TEST(EngineFactoryTest, Bf16KvHalvesThePage) {
  EngineOptions o = Tiny();
  o.kv_dtype = "bf16";
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->layout().kv_dtype, DType::kBf16);
  EXPECT_EQ((*engine)->layout().num_pages, 64);
}

// fp8 and int8: one-byte codes and a scale per token and kv head, on either backend.
struct OneByteKv {
  const char* flag;
  DType dtype;
};
class OneByteKvTest : public ::testing::TestWithParam<OneByteKv> {};

TEST_P(OneByteKvTest, OnCpuFitsAboutTwiceTheBf16Tokens) {
  // A page: 2 layers x (K + V) x 16 tokens x 2 heads x (64 codes + a 4-byte scale) = 8704 B;
  // 1 MiB holds 120 pages (bf16: 16384 B a page, 64 pages).
  EngineOptions o = Tiny();
  o.device = "cpu";
  o.kv_dtype = GetParam().flag;
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->backend(), "cpu");
  EXPECT_EQ((*engine)->layout().kv_dtype, GetParam().dtype);
  EXPECT_EQ((*engine)->layout().bytes_per_page(), 8704);
  EXPECT_EQ((*engine)->layout().num_pages, (1 << 20) / 8704);
  EXPECT_EQ((*engine)->layout().num_pages, 120);

  o.shards = 2;  // each shard keeps its kv head's scales; the page count is the whole pool's
  engine = CreateEngine(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->layout().num_pages, 120);
  EXPECT_EQ((*engine)->layout().kv_dtype, GetParam().dtype);
}

TEST_P(OneByteKvTest, OnCudaTakesTheSamePool) {
  // The pool of the cpu test above: 120 pages of 8704 B in 1 MiB (kv_cache_bytes is the pool's
  // own size; the engine's prefill scratch comes on top).
  EngineOptions o = Tiny();
  o.device = "cuda";
  o.kv_dtype = GetParam().flag;
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(o);
  if (!CudaBuildStatus().ok()) {  // no CUDA backend in this build: that is reported first
    EXPECT_EQ(engine.status(), CudaBuildStatus());
    return;
  }
  if (CudaDeviceCount() == 0) {
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine.status().message(),
              "EngineOptions::device cuda: no usable CUDA device (no GPU or no driver); use cpu");
    return;
  }
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->backend(), "cuda");
  EXPECT_EQ((*engine)->layout().kv_dtype, GetParam().dtype);
  EXPECT_EQ((*engine)->layout().bytes_per_page(), 8704);
  EXPECT_EQ((*engine)->layout().num_pages, 120);
}

INSTANTIATE_TEST_SUITE_P(Fp8AndInt8, OneByteKvTest,
                         ::testing::Values(OneByteKv{"fp8", DType::kFp8E4m3},
                                           OneByteKv{"int8", DType::kInt8}),
                         [](const ::testing::TestParamInfo<OneByteKv>& info) {
                           return std::string(info.param.flag);
                         });

TEST(EngineFactoryTest, CudaWithoutAGpuIsAClearStartupError) {
  EngineOptions o = Tiny();
  o.device = "cuda";
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(o);
  if (!CudaBuildStatus()
           .ok()) {  // built without a CUDA toolkit (server/engine/cuda_engine_stub.cc)
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine.status().message(),
              "the cuda backend: attnd was built without CUDA (no toolkit found at build time); "
              "rebuild with a CUDA toolkit >= 12 (see docs/BUILD.md)");
    return;
  }
  if (CudaDeviceCount() > 0) {
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->backend(), "cuda");
    EXPECT_EQ((*engine)->layout().kv_dtype, DType::kBf16);
    return;
  }
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine.status().message(),
            "EngineOptions::device cuda: no usable CUDA device (no GPU or no driver); use cpu");
}

TEST(EngineFactoryTest, AutoPicksCudaOnlyWithAGpu) {
  EngineOptions o = Tiny();
  o.device = "auto";
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->backend(), CudaDeviceCount() > 0 ? "cuda" : "cpu");
}

TEST(EngineFactoryTest, CudaRefusesFp32Kv) {
  EngineOptions o = Tiny();
  o.device = "cuda";
  o.kv_dtype = "fp32";
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(o);
  if (!CudaBuildStatus().ok()) {  // no CUDA backend in this build: that is reported first
    EXPECT_EQ(engine.status(), CudaBuildStatus());
    return;
  }
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message(),
            "EngineOptions::kv_dtype: the cuda backend stores K/V as bf16, int8 or fp8; use auto, "
            "bf16, int8 or fp8");
}

TEST(EngineFactoryTest, BadOptionsNameTheFlag) {
  EngineOptions o = Tiny();
  o.device = "tpu";
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(o);
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message(),
            "EngineOptions::device must be auto, cpu or cuda, got \"tpu\"");

  for (const char* bad : {"fp16", "int4", "INT8", "FP8", "e4m3", "uint8", ""}) {
    o = Tiny();
    o.kv_dtype = bad;
    engine = CreateEngine(o);
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(engine.status().message(),
              absl::StrCat("EngineOptions::kv_dtype must be auto, bf16, fp32, fp8 or int8, got \"",
                           bad, "\""));
  }

  o = Tiny();
  o.kv_cache_bytes = 1000;  // less than one page
  engine = CreateEngine(o);
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message().substr(0, 25), "a KV pool of 1000 bytes: ");
}

}  // namespace
}  // namespace attnd
