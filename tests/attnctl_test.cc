// attnctl's subcommands (client/attnctl.h) against an in-process daemon: info prints the served
// geometry, smoke passes on a correct server and says when its token cap keeps it inside fewer DCA
// chunks, bench prints its table; none of them leaves a sequence or a page behind.
#include "client/attnctl.h"

#include <cstdio>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

class AttnctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    geometry_.name = "attnctl-tiny";
    ServerOptions options;
    options.page_size = 16;
    options.kv_dtype = "fp32";
    options.kv_cache_bytes = 16ll << 20;
    options.compute_threads = 2;
    absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
        testing::TestDaemon::Start(geometry_, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
  }

  void ExpectNothingLeft() {
    absl::StatusOr<v1::GetServerInfoResponse> info = daemon_->client().Info();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->live_sequences(), 0);
    EXPECT_EQ(info->kv_cache().pages_free(), info->kv_cache().pages_total());
  }

  testing::ModelGeometry geometry_;
  std::unique_ptr<testing::TestDaemon> daemon_;
};

TEST_F(AttnctlTest, InfoPrintsAlignedGeometry) {
  std::ostringstream out, err;
  EXPECT_EQ(client::RunInfo(daemon_->client(), out, err), 0) << err.str();
  const std::string s = out.str();
  // Keys padded to one column: "layers:" is followed by spaces up to the widest key's colon.
  EXPECT_THAT(s, ContainsRegex("\nlayers: +2\n"));
  EXPECT_THAT(s, ContainsRegex("\nq heads: +4\n"));
  EXPECT_THAT(s, ContainsRegex("\ndca chunk len: +128\n"));
  EXPECT_THAT(s, ContainsRegex("\nkv dtype: +fp32\n"));
  EXPECT_THAT(s, HasSubstr("model:"));
  EXPECT_THAT(s, Not(HasSubstr("device-ordered rings:")));  // the CPU backend orders none
  const size_t a = s.find("layers:"), b = s.find("dca chunk len:");
  const size_t va = s.find_first_not_of(' ', a + 7), vb = s.find_first_not_of(' ', b + 14);
  EXPECT_EQ(va - s.rfind('\n', a), vb - s.rfind('\n', b)) << "values are not aligned:\n" << s;
}

TEST_F(AttnctlTest, InfoNamesAFleetMemberAndSmokePassesOnIt) {
  std::ostringstream unnamed_out, unnamed_err;
  EXPECT_EQ(client::RunInfo(daemon_->client(), unnamed_out, unnamed_err), 0);
  EXPECT_THAT(unnamed_out.str(), Not(HasSubstr("instance:")));

  ServerOptions options;
  options.page_size = 16;
  options.kv_dtype = "fp32";
  options.kv_cache_bytes = 16ll << 20;
  options.compute_threads = 2;
  options.instance_name = "attnd-7";
  options.advertise_address = "attnd-7.attnd-headless.default.svc:50051";
  absl::StatusOr<std::unique_ptr<testing::TestDaemon>> named =
      testing::TestDaemon::Start(geometry_, options);
  ASSERT_TRUE(named.ok()) << named.status();
  std::ostringstream out, err;
  EXPECT_EQ(client::RunInfo((*named)->client(), out, err), 0) << err.str();
  EXPECT_THAT(out.str(),
              ContainsRegex("\ninstance: +attnd-7 at attnd-7.attnd-headless.default.svc:50051\n"));
  std::ostringstream smoke_out, smoke_err;
  client::SmokeOptions smoke;
  smoke.decode_steps = 2;
  EXPECT_EQ(client::RunSmoke((*named)->client(), smoke, smoke_out, smoke_err), 0)
      << smoke_out.str() << smoke_err.str();
  EXPECT_THAT(smoke_out.str(), HasSubstr("\nPASS max_abs_err="));
}

// A one-byte pool (fp8 E4M3, int8): GetServerInfo and info report the dtype and how many tokens
// fit (scales counted), and smoke passes against the fp64 reference within the dtype's bars.
struct OneByteKv {
  const char* flag;
  v1::DType wire;
  const char* name;  // as info and smoke print it
};
class AttnctlOneByteKvTest : public AttnctlTest, public ::testing::WithParamInterface<OneByteKv> {};

TEST_P(AttnctlOneByteKvTest, InfoShowsTheDtypeAndTheTokensThatFit) {
  ServerOptions options;
  options.page_size = 16;
  options.kv_dtype = GetParam().flag;
  options.kv_cache_bytes = 1 << 20;
  options.compute_threads = 2;
  absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
      testing::TestDaemon::Start(geometry_, options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  absl::StatusOr<v1::GetServerInfoResponse> info = (*daemon)->client().Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->model().kv_dtype(), GetParam().wire);
  // 2 layers x K and V x 16 tokens x 2 kv heads x (64 one-byte codes + a 4-byte scale) = 8704 B.
  EXPECT_EQ(info->kv_cache().bytes_per_page(), 8704);
  EXPECT_EQ(info->kv_cache().pages_total(), (1 << 20) / 8704);
  std::ostringstream out, err;
  EXPECT_EQ(client::RunInfo((*daemon)->client(), out, err), 0) << err.str();
  EXPECT_THAT(out.str(), ContainsRegex(absl::StrCat("\nkv dtype: +", GetParam().name,
                                                    " \\(fp32 scale per token and kv head\\)\n")));
  EXPECT_THAT(out.str(), ContainsRegex("\npages: +120 free of 120 \\(1920 tokens\\)\n"));
  EXPECT_THAT(out.str(), ContainsRegex("\nbytes per token: +544 B\n"));
  std::ostringstream smoke_out, smoke_err;
  client::SmokeOptions smoke;
  smoke.decode_steps = 4;
  EXPECT_EQ(client::RunSmoke((*daemon)->client(), smoke, smoke_out, smoke_err), 0)
      << smoke_out.str() << smoke_err.str();
  EXPECT_THAT(smoke_out.str(), HasSubstr(absl::StrCat("kv cache ", GetParam().name)));
  EXPECT_THAT(smoke_out.str(), HasSubstr("\nPASS max_abs_err="));
  std::printf("%s smoke: %s", GetParam().flag,
              smoke_out.str().substr(smoke_out.str().find("\nPASS") + 1).c_str());
}

INSTANTIATE_TEST_SUITE_P(Fp8AndInt8, AttnctlOneByteKvTest,
                         ::testing::Values(OneByteKv{"fp8", v1::DTYPE_FP8_E4M3, "fp8_e4m3"},
                                           OneByteKv{"int8", v1::DTYPE_INT8, "int8"}),
                         [](const ::testing::TestParamInfo<OneByteKv>& info) {
                           return std::string(info.param.flag);
                         });

TEST_F(AttnctlTest, SmokePassesAcrossThreeChunksInEveryDtype) {
  for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    std::ostringstream out, err;
    client::SmokeOptions options;
    options.dtype = dtype;
    options.decode_steps = 6;
    EXPECT_EQ(client::RunSmoke(daemon_->client(), options, out, err), 0) << out.str() << err.str();
    EXPECT_THAT(out.str(), HasSubstr("spans:    3 DCA chunks (stages: intra, succ, inter)"));
    EXPECT_THAT(out.str(), HasSubstr("sequence: 320 tokens"));
    EXPECT_THAT(out.str(), HasSubstr("\nPASS max_abs_err="));
    EXPECT_THAT(out.str(), Not(HasSubstr("NOTE")));
    ExpectNothingLeft();
  }
}

TEST_F(AttnctlTest, SmokeSaysWhenTheCapKeepsItInsideFewerChunks) {
  std::ostringstream out, err;
  client::SmokeOptions options;
  options.max_tokens = 200;  // chunk_len 128: two chunks, no inter stage
  options.layers = 1;
  options.decode_steps = 3;
  EXPECT_EQ(client::RunSmoke(daemon_->client(), options, out, err), 0) << out.str() << err.str();
  EXPECT_THAT(out.str(), HasSubstr("NOTE: the token cap (200, --max-tokens) is below 320"));
  EXPECT_THAT(out.str(), HasSubstr("spans only 2 chunks, so the inter stage is not exercised"));
  EXPECT_THAT(out.str(), HasSubstr("layers 1 of 2"));
  EXPECT_THAT(out.str(), HasSubstr("\nPASS "));
  ExpectNothingLeft();
}

TEST_F(AttnctlTest, SmokeRejectsTooManyLayers) {
  std::ostringstream out, err;
  client::SmokeOptions options;
  options.layers = 3;
  EXPECT_EQ(client::RunSmoke(daemon_->client(), options, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("--layers 3 is not in [1, 2]"));
  ExpectNothingLeft();
}

TEST_F(AttnctlTest, SmokeProgressGoesToErrOnePerPrefillCallAndDecodeTenth) {
  std::ostringstream out, err;
  client::SmokeOptions options;
  options.layers = 2;
  options.decode_steps = 20;
  options.progress = true;
  ASSERT_EQ(client::RunSmoke(daemon_->client(), options, out, err), 0) << out.str() << err.str();
  const std::string e = err.str();
  EXPECT_THAT(e,
              ContainsRegex("smoke: prefill call 1/[0-9]+ done: tokens 0\\.\\.[0-9]+ of [0-9]+, 2 "
                            "layers checked, [0-9.]+ s\n"));
  EXPECT_THAT(e, HasSubstr("smoke: decode step 2/20 done, 2 layers checked"));
  EXPECT_THAT(e, HasSubstr("smoke: decode step 20/20 done"));
  EXPECT_THAT(e, Not(HasSubstr("decode step 3/20")));  // one line per tenth, not per step
  EXPECT_THAT(out.str(), Not(HasSubstr("smoke: ")));   // the report stays clean
  ExpectNothingLeft();

  // Off by default.
  std::ostringstream quiet_out, quiet_err;
  options.progress = false;
  ASSERT_EQ(client::RunSmoke(daemon_->client(), options, quiet_out, quiet_err), 0);
  EXPECT_THAT(quiet_err.str(), Not(HasSubstr("smoke: ")));
}

TEST_F(AttnctlTest, BenchPrintsATableAndReleasesEverything) {
  std::ostringstream out, err;
  client::BenchOptions options;
  options.contexts = {64, 300, 100000};  // the last is past max_position_embeddings (4096)
  options.prefill_chunk = 100;
  options.decode_steps = 5;
  options.batch = 3;
  options.layers = 0;
  options.progress = false;
  EXPECT_EQ(client::RunBench(daemon_->client(), options, out, err), 0) << err.str();
  const std::string s = out.str();
  EXPECT_THAT(s, HasSubstr("2 of 2 layers, bf16, batch 3, prefill chunk 100, 5 decode steps"));
  EXPECT_THAT(s, HasSubstr("decode ms/step p99"));
  EXPECT_THAT(s, HasSubstr("decode us/layer p99"));
  EXPECT_THAT(s, HasSubstr("\ntransport: grpc (unary RPCs, tensor bytes in the messages)\n"));
  EXPECT_THAT(s, ContainsRegex("\n +64( +[0-9.]+){7}\n"));
  EXPECT_THAT(s, ContainsRegex("\n +300( +[0-9.]+){7}\n"));
  EXPECT_THAT(s, HasSubstr("100000  skipped: context + decode steps > max sequence length 4096"));
  ExpectNothingLeft();

  // A run the pool cannot hold is skipped with what it needs and how to fit it.
  std::ostringstream big_out, big_err;
  options.contexts = {4000};
  options.decode_steps = 90;
  options.batch = 64;
  EXPECT_EQ(client::RunBench(daemon_->client(), options, big_out, big_err), 0) << big_err.str();
  EXPECT_THAT(big_out.str(),
              ContainsRegex("4000  skipped: needs 16384 KV pages \\(64 sequences of 4000 \\+ 90 "
                            "decode steps\\), [0-9]+ free: fewer --decode-steps or --batch, or a "
                            "larger attnd --kv-cache-bytes"));
  ExpectNothingLeft();
}

TEST_F(AttnctlTest, BenchOverASessionAndUnknownTransports) {
  std::ostringstream out, err;
  client::BenchOptions options;
  options.contexts = {40};
  options.prefill_chunk = 16;
  options.decode_steps = 3;
  options.progress = false;
  options.transports = {"grpc", "session"};
  EXPECT_EQ(client::RunBench(daemon_->client(), options, out, err), 0) << err.str();
  EXPECT_THAT(out.str(), HasSubstr("\ntransport: session (one Session stream"));
  EXPECT_THAT(out.str(), ContainsRegex("transport: session[^\n]*\n[^\n]*\n +40( +[0-9.]+){7}\n"));
  ExpectNothingLeft();
  std::ostringstream out2, err2;
  options.transports = {"carrier-pigeon"};
  EXPECT_EQ(client::RunBench(daemon_->client(), options, out2, err2), 2);
  EXPECT_THAT(err2.str(), HasSubstr("not one of grpc, session, shm, ring, cuda-ipc"));
}

}  // namespace
}  // namespace attnd
