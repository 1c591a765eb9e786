#include "version/build_info.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(BuildInfo, VersionTextNamesProgramVersionRevisionAndBuild) {
  const std::string text = VersionText("attnd");
  EXPECT_TRUE(absl::StartsWith(text, absl::StrCat("attnd ", kVersion, "\n"))) << text;
  EXPECT_TRUE(absl::StrContains(text, absl::StrCat("revision: ", GitRevision(), "\n"))) << text;
  EXPECT_TRUE(absl::StrContains(text, absl::StrCat("build: ", CompilationMode()))) << text;
  EXPECT_TRUE(absl::StrContains(text, BuiltWithCuda() ? "CUDA backend: yes" : "CUDA backend: no"));
  EXPECT_FALSE(GitRevision().empty());
  if (absl::StartsWith(GitRevision(), "unknown")) {
    EXPECT_EQ(StampedRevision(), "");
  } else {
    EXPECT_EQ(StampedRevision(), GitRevision());
  }
  const absl::string_view mode = CompilationMode();
  EXPECT_TRUE(mode == "opt" || mode == "dbg" || mode == "fastbuild") << mode;
}

TEST(BuildInfo, MainFileFilterMatchesOnlyThatFile) {
  EXPECT_TRUE(IsMainFile("server/main.cc", "server/main.cc"));
  EXPECT_TRUE(IsMainFile("/src/attnd/server/main.cc", "server/main.cc"));
  EXPECT_FALSE(IsMainFile("client/main.cc", "server/main.cc"));
  EXPECT_FALSE(IsMainFile("xserver/main.cc", "server/main.cc"));
  EXPECT_FALSE(IsMainFile("absl/flags/parse.cc", "server/main.cc"));
}

TEST(BuildInfo, NormalizeFilenameKeepsTheRepositoryPath) {
  EXPECT_EQ(NormalizeFilename("/home/u/.cache/bazel/execroot/attnd/server/main.cc"),
            "server/main.cc");
  EXPECT_EQ(NormalizeFilename("client/main.cc"), "client/main.cc");
  EXPECT_EQ(NormalizeFilename("/usr/include/absl/flags/parse.cc"),
            "/usr/include/absl/flags/parse.cc");
}

TEST(BuildInfo, ShortHelpBecomesHelpBeforeDoubleDash) {
  char a0[] = "attnd", a1[] = "-h", a2[] = "--", a3[] = "-h";
  char* argv[] = {a0, a1, a2, a3};
  ShortHelpToHelp(4, argv);
  EXPECT_STREQ(argv[1], "--help");
  EXPECT_STREQ(argv[3], "-h");
}

}  // namespace
}  // namespace attnd
