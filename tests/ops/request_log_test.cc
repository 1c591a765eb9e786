// The request log through the real daemon: with --request-log-sample 1 every RPC gives one line
// with its method, tenant, sequence id prefix, tokens, code and latency; with 0 only errors do.
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace ops_testing;  // NOLINT

// Captures what spdlog's default logger writes while it lives.
class CapturedLog {
 public:
  CapturedLog() : previous_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_, /*force_flush=*/true);
    auto logger = std::make_shared<spdlog::logger>("captured", sink);
    logger->set_level(spdlog::level::info);
    spdlog::set_default_logger(logger);
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }
  std::string text() {
    spdlog::default_logger()->flush();
    return out_.str();
  }

 private:
  std::shared_ptr<spdlog::logger> previous_;
  std::ostringstream out_;
};

grpc::Status Release(v1::Attention::Stub* stub, const std::string& id) {
  auto ctx = Context();
  v1::ReleaseSequenceRequest req;
  req.set_sequence_id(id);
  v1::ReleaseSequenceResponse resp;
  return stub->ReleaseSequence(ctx.get(), req, &resp);
}

TEST(RequestLogTest, EveryRpcOneLineWhenSampleIsOne) {
  CapturedLog log;
  ServerOptions o = TinyOptions(64);
  o.request_log_sample = 1;
  std::string id;
  {
    Daemon daemon(o);
    ASSERT_TRUE(daemon.ok());
    auto stub = daemon.Stub();
    std::mt19937 rng(3);
    id = MustCreate(stub.get());
    auto ctx = Context();
    v1::PrefillResponse resp;
    ASSERT_TRUE(stub->Prefill(ctx.get(), MakePrefill(id, 0, 40, &rng), &resp).ok());
    EXPECT_EQ(Release(stub.get(), "0123456789abcdef0123456789abcdef").error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  const std::string text = log.text();
  EXPECT_THAT(text, HasSubstr("request method=CreateSequence tenant=- seq=- code=OK latency_us="));
  EXPECT_THAT(text, ContainsRegex("request method=Prefill tenant=- seq=" + id.substr(0, 8) +
                                  " tokens=40 code=OK latency_us=[0-9]+"));
  EXPECT_THAT(text,
              HasSubstr("request method=ReleaseSequence tenant=- seq=01234567 code=NOT_FOUND"));
  EXPECT_THAT(text, Not(HasSubstr(id.substr(8))));  // only the prefix of an id is logged
}

TEST(RequestLogTest, SampleZeroLogsOnlyErrors) {
  CapturedLog log;
  ServerOptions o = TinyOptions(64);
  o.request_log_sample = 0;
  {
    Daemon daemon(o);
    ASSERT_TRUE(daemon.ok());
    auto stub = daemon.Stub();
    for (int i = 0; i < 5; ++i) MustCreate(stub.get());
    EXPECT_EQ(Release(stub.get(), "not-an-id").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  const std::string text = log.text();
  EXPECT_THAT(text, Not(HasSubstr("method=CreateSequence")));
  EXPECT_THAT(text,
              HasSubstr("method=ReleaseSequence tenant=- seq=not-an-i code=INVALID_ARGUMENT"));
}

}  // namespace
}  // namespace attnd
