// Where a golden DCA case of tests/testdata/dca is at test time: in the test's runfiles (the test
// lists
// //tests/testdata:dca in its data). Header-only and dependency-free so kernel tests can use it
// too.
#ifndef ATTND_TESTS_TESTDATA_GOLDEN_DIR_H_
#define ATTND_TESTS_TESTDATA_GOLDEN_DIR_H_

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace attnd {
namespace testing {

// <runfiles>/<workspace>/tests/testdata/dca/<name>, the runfiles being $TEST_SRCDIR under `bazel
// test`, $RUNFILES_DIR under `bazel run`, else <this binary>.runfiles (bazel-bin/... run by hand).
// The caller checks that the case is there and fails the test if not (never a skip).
inline std::string GoldenCaseDir(const std::string& name) {
  std::string root;
  if (const char* env = std::getenv("TEST_SRCDIR")) {
    root = env;
  } else if (const char* env = std::getenv("RUNFILES_DIR")) {
    root = env;
  } else {
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) root = std::string(exe, n) + ".runfiles";
  }
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return root + "/" + (workspace != nullptr ? workspace : "attnd") + "/tests/testdata/dca/" + name;
}

}  // namespace testing
}  // namespace attnd

#endif  // ATTND_TESTS_TESTDATA_GOLDEN_DIR_H_
