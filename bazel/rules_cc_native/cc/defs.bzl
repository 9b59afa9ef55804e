"""@rules_cc//cc:defs.bzl as Bazel 4's built-in C++ rules, without a download.

Bazel 4's own @bazel_tools//tools/cpp loads its rules from @rules_cc, which it
would fetch from GitHub; these forwarders to the native rules (which is all the
rules_cc release pinned by Bazel 4 does) let the build run offline. Debian's
bazel-rules-cc package is a newer rules_cc that Bazel 4 cannot load.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
