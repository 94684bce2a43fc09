"""The @rules_cc//cc:defs.bzl that Bazel 4's @bazel_tools and C++ toolchain
setup (@local_config_cc) load.

Bazel's WORKSPACE suffix would download rules_cc for it; the real file only wraps the native
rules, so these are the same rules, offline.
"""

cc_binary = native.cc_binary
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_library = native.objc_library
