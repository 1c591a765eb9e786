// attnd's version and build (git revision, compilation mode, CUDA or not), and the --help / -h /
// --version set-up that attnd and attnctl share.
#ifndef ATTND_VERSION_BUILD_INFO_H_
#define ATTND_VERSION_BUILD_INFO_H_

#include <string>

#include "absl/strings/string_view.h"

namespace attnd {

// The release version, as GetServerInfo and attnd_build_info report it.
inline constexpr char kVersion[] = "0.1.0";

// The git revision the binary was built from (12 hex digits, "-dirty" with uncommitted changes),
// stamped by `bazel build --stamp`; "unknown (not stamped; build with --stamp)" otherwise.
absl::string_view GitRevision();
// GitRevision() when the build was stamped (a 12-digit revision), else "" (attnd_build_info's
// revision label).
std::string StampedRevision();
// Bazel's compilation mode: "opt", "dbg" or "fastbuild" (attnd's .bazelrc builds fastbuild with
// -O2).
absl::string_view CompilationMode();
// Whether the CUDA backend was built in (a toolkit was found at build time).
bool BuiltWithCuda();

// "PROGRAM 0.1.0\nrevision: ...\nbuild: fastbuild (-O2, asserts off), CUDA backend: yes|no\n"
std::string VersionText(absl::string_view program);

// Whether a flag defined in `file` (as __FILE__ spells it) belongs to `main_file`
// ("server/main.cc"): equal, or ending in "/" + main_file.
bool IsMainFile(absl::string_view file, absl::string_view main_file);
// `file` from its last "server/", "client/", ... component on: the repository-relative path.
std::string NormalizeFilename(absl::string_view file);

// Sets absl's usage config so that --help and --helpshort list the flags defined in `main_file`
// (the binary's main.cc, where every flag of attnd and attnctl lives) and --version prints
// VersionText(program).
void SetUsageConfig(absl::string_view program, absl::string_view main_file);

// Rewrites a bare "-h" argument (before any "--") to "--help", which absl does not know by itself.
void ShortHelpToHelp(int argc, char** argv);

}  // namespace attnd

#endif  // ATTND_VERSION_BUILD_INFO_H_
