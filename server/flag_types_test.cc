#include "server/flag_types.h"

#include <string>

#include "absl/flags/marshalling.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

using ::testing::HasSubstr;

TEST(ParseByteSize, NumbersAndUnits) {
  struct Case {
    const char* text;
    int64_t bytes;
  } cases[] = {
      {"0", 0},
      {"4096", 4096},
      {"1K", 1000},
      {"1k", 1000},
      {"1KB", 1000},
      {"1Ki", 1024},
      {"1KiB", 1024},
      {"512Mi", 512ll << 20},
      {"512mib", 512ll << 20},
      {"1G", 1000000000},
      {"1Gi", 1ll << 30},
      {"4 GiB", 4ll << 30},
      {"2T", 2000000000000},
      {"1Ti", 1ll << 40},
      {"1.5G", 1500000000},
      {"0.5Ki", 512},
      {"16B", 16},
      {" 64Mi ", 64ll << 20},
  };
  for (const Case& c : cases) {
    absl::StatusOr<int64_t> got = ParseByteSize(c.text);
    ASSERT_TRUE(got.ok()) << c.text << ": " << got.status();
    EXPECT_EQ(*got, c.bytes) << c.text;
  }
}

TEST(ParseByteSize, RejectsWithTheExpectedForms) {
  for (const char* text : {"", "G", "1X", "1Gig", "-1", "-1G", "1.5", "0.3Ki", "1e9", "9000000Ti",
                           "99999999999999999999", "1..5G", "abc"}) {
    absl::StatusOr<int64_t> got = ParseByteSize(text);
    ASSERT_FALSE(got.ok()) << text << " parsed as " << *got;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(got.status().message()), HasSubstr("expected a byte count")) << text;
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(absl::StrCat("\"", text, "\"")));
  }
  EXPECT_THAT(std::string(ParseByteSize("-5").status().message()), HasSubstr("negative"));
  EXPECT_THAT(std::string(ParseByteSize("9000000Ti").status().message()), HasSubstr("2^63-1"));
}

TEST(FormatByteSize, ShortestExactAndRoundTrips) {
  EXPECT_EQ(FormatByteSize(0), "0");
  EXPECT_EQ(FormatByteSize(512ll << 20), "512Mi");
  EXPECT_EQ(FormatByteSize(4ll << 30), "4Gi");
  EXPECT_EQ(FormatByteSize(1536), "1536");
  EXPECT_EQ(FormatByteSize(3072), "3Ki");
  EXPECT_EQ(FormatByteSize(1500000000), "1500000000");
  for (int64_t n : {int64_t{1}, int64_t{1023}, int64_t{1} << 30, (int64_t{3} << 40) + 1024}) {
    absl::StatusOr<int64_t> back = ParseByteSize(FormatByteSize(n));
    ASSERT_TRUE(back.ok()) << n;
    EXPECT_EQ(*back, n);
  }
}

TEST(ParseFlexDuration, BareNumbersAreSeconds) {
  EXPECT_EQ(*ParseFlexDuration("30"), absl::Seconds(30));
  EXPECT_EQ(*ParseFlexDuration("0"), absl::ZeroDuration());
  EXPECT_EQ(*ParseFlexDuration("0.5"), absl::Milliseconds(500));
  EXPECT_EQ(*ParseFlexDuration("30s"), absl::Seconds(30));
  EXPECT_EQ(*ParseFlexDuration("1m30s"), absl::Seconds(90));
  EXPECT_EQ(*ParseFlexDuration("250ms"), absl::Milliseconds(250));
  EXPECT_EQ(*ParseFlexDuration("2h"), absl::Hours(2));
  EXPECT_EQ(*ParseFlexDuration("inf"), absl::InfiniteDuration());
  for (const char* text : {"", "30x", "thirty", "s", "1.2.3"}) {
    absl::StatusOr<absl::Duration> d = ParseFlexDuration(text);
    ASSERT_FALSE(d.ok()) << text;
    EXPECT_THAT(std::string(d.status().message()), HasSubstr("expected a duration")) << text;
  }
}

TEST(FlagTypes, AbslFlagMarshalling) {
  ByteSize b;
  std::string error;
  ASSERT_TRUE(absl::ParseFlag("1G", &b, &error)) << error;
  EXPECT_EQ(b.bytes, 1000000000);
  EXPECT_FALSE(absl::ParseFlag("1X", &b, &error));
  EXPECT_THAT(error, HasSubstr("expected a byte count"));
  EXPECT_EQ(absl::UnparseFlag(ByteSize{2ll << 30}), "2Gi");
  FlexDuration d;
  ASSERT_TRUE(absl::ParseFlag("30", &d, &error)) << error;
  EXPECT_EQ(d.value, absl::Seconds(30));
  EXPECT_EQ(absl::UnparseFlag(FlexDuration{absl::Seconds(30)}), "30s");
}

}  // namespace
}  // namespace attnd
