"""The @rules_java//java:defs.bzl that @bazel_tools//tools/jdk loads (toolchain resolution reads
every registered toolchain, Java's too, even for C++ and Python targets).

Bazel's WORKSPACE suffix would download rules_java for it; the real file only wraps the native
rules, so these are the same rules, offline.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
