"""Offline stand-in for @rules_cc//cc:defs.bzl: re-exports Bazel 4's native C++ rules.

Bazel's own tools (@bazel_tools//tools/cpp, which even py_test resolves) load their C++ rules from
@rules_cc, which Bazel would download. Bazel 4.2 still has these rules built in, so forwarding to
`native` is exactly what the real rules_cc of that era did. (Debian's bazel-rules-cc 0.0.4 needs a
newer Bazel than Debian's bazel-bootstrap 4.2.3.)
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_shared_library = getattr(native, "cc_shared_library", None)
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
fdo_prefetch_hints = native.fdo_prefetch_hints
fdo_profile = native.fdo_profile
objc_import = native.objc_import
objc_library = native.objc_library
