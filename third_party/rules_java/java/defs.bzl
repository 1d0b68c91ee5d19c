"""Offline stand-in for @rules_java//java:defs.bzl: re-exports Bazel 4's native Java rules.

@bazel_tools//tools/jdk (whose toolchains Bazel registers for every build, Python tests included)
loads these rules from @rules_java, which Bazel would download. Bazel 4.2 still has them built in.
No Java is compiled for this project.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_plugin = native.java_plugin
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
