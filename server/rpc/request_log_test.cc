// RequestLog's sampling and per-second cap, driven by a ManualClock.
#include "server/rpc/request_log.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class RequestLogTest : public ::testing::Test {
 protected:
  RequestLog Make(int64_t sample, int64_t cap) {
    RequestLogOptions o;
    o.sample = sample;
    o.max_lines_per_second = cap;
    return RequestLog(o, &clock_, [this](const std::string& line) { lines_.push_back(line); });
  }
  static RequestLogEntry Ok(int64_t tokens = 1) {
    RequestLogEntry e;
    e.method = "Prefill";
    e.tenant = "team-a";
    e.sequence_id = "0123456789abcdef0123456789abcdef";
    e.tokens = tokens;
    e.latency_us = 250;
    return e;
  }
  static RequestLogEntry Error(int code) {
    RequestLogEntry e = Ok();
    e.code = code;
    return e;
  }
  int64_t Count(absl::string_view needle) const {
    int64_t n = 0;
    for (const std::string& l : lines_) n += absl::StrContains(l, needle) ? 1 : 0;
    return n;
  }

  ManualClock clock_;
  std::vector<std::string> lines_;
};

TEST_F(RequestLogTest, LineHasEveryField) {
  RequestLog log = Make(1, 0);
  log.Log(Ok(512));
  RequestLogEntry e;
  e.method = "CreateSequence";
  e.code = 8;
  log.Log(e);
  EXPECT_THAT(lines_, ElementsAre("request method=Prefill tenant=team-a seq=01234567 tokens=512 "
                                  "code=OK latency_us=250",
                                  "request method=CreateSequence tenant=- seq=- "
                                  "code=RESOURCE_EXHAUSTED"));
}

TEST_F(RequestLogTest, AFleetMembersIdKeepsItsInstance) {
  RequestLog log = Make(1, 0);
  RequestLogEntry e = Ok();
  e.sequence_id = "attnd-3.0123456789abcdef0123456789abcdef";
  log.Log(e);
  const std::string long_prefix = std::string(100, 'x') + ".0123456789abcdef";  // not a name
  e.sequence_id = long_prefix;
  log.Log(e);
  EXPECT_THAT(lines_, ElementsAre(HasSubstr(" seq=attnd-3.01234567 tokens="),
                                  HasSubstr(" seq=xxxxxxxx tokens=")));
}

// A client's id is logged before it is checked: its bytes must not make a line of their own.
TEST_F(RequestLogTest, ClientStringsCannotForgeLines) {
  RequestLog log = Make(1, 0);
  RequestLogEntry e = Error(3);
  const std::string id = std::string("a\nrequest method=Admin tenant=root code=OK\x1b[2J\0x.", 49) +
                         "0123456789abcdef0123456789abcdef";
  e.sequence_id = id;
  e.tenant = "t\r\nx";
  log.Log(e);
  ASSERT_EQ(lines_.size(), 1u);
  for (char c : lines_[0]) {
    EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "byte " << static_cast<int>(c) << " in " << lines_[0];
  }
  EXPECT_THAT(lines_[0], HasSubstr("tenant=t\\r\\nx "));
  EXPECT_THAT(lines_[0], HasSubstr("seq=a\\nrequest"));
}

TEST_F(RequestLogTest, OneInNOkRequestsAndEveryError) {
  RequestLog log = Make(10, 0);
  for (int i = 0; i < 95; ++i) log.Log(Ok(i));
  EXPECT_EQ(lines_.size(), 10u);  // requests 0, 10, ..., 90
  EXPECT_THAT(lines_[0], HasSubstr("tokens=0 "));
  EXPECT_THAT(lines_[1], HasSubstr("tokens=10 "));
  for (int i = 0; i < 7; ++i) log.Log(Error(5));
  EXPECT_EQ(Count("code=NOT_FOUND"), 7);

  RequestLog none = Make(0, 0);
  lines_.clear();
  for (int i = 0; i < 50; ++i) none.Log(Ok());
  none.Log(Error(13));
  EXPECT_THAT(lines_, ElementsAre(HasSubstr("code=INTERNAL")));
}

TEST_F(RequestLogTest, CapPerSecondCountsWhatItSuppressed) {
  RequestLog log = Make(1, 3);
  for (int i = 0; i < 10; ++i) log.Log(Error(5));
  EXPECT_EQ(lines_.size(), 3u);  // the other 7 are held back this second
  clock_.Advance(absl::Milliseconds(500));
  log.Log(Ok());
  EXPECT_EQ(lines_.size(), 3u);  // still the same second (ManualClock starts on a whole second)
  clock_.Advance(absl::Milliseconds(600));
  log.Log(Ok(42));
  ASSERT_EQ(lines_.size(), 5u);
  EXPECT_EQ(lines_[3], "request log: suppressed 8 lines (cap 3 per second)");
  EXPECT_THAT(lines_[4], HasSubstr("tokens=42 "));
  // The count starts again after it is reported.
  log.Log(Ok());
  log.Log(Ok());
  log.Log(Ok());
  clock_.Advance(absl::Seconds(1));
  log.Log(Ok());
  EXPECT_EQ(lines_.back(),
            "request method=Prefill tenant=team-a seq=01234567 tokens=1 code=OK "
            "latency_us=250");
  EXPECT_EQ(lines_[lines_.size() - 2], "request log: suppressed 1 lines (cap 3 per second)");
}

}  // namespace
}  // namespace attnd
