"""Re-exports Bazel's native C++ rules under @rules_cc, so Bazel 4.2.3 never fetches rules_cc.

Debian's bazel-rules-cc is too new for Debian's Bazel 4.2.3 (see docs/BUILD.md).
"""

cc_library = native.cc_library
cc_binary = native.cc_binary
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
cc_import = native.cc_import
