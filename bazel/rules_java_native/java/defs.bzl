"""@rules_java//java:defs.bzl as Bazel 4's built-in Java rules, without a download.

Bazel 4 parses @bazel_tools//tools/jdk (its registered Java toolchains) even for
a C++-only build, and that package loads @rules_java, which Bazel would fetch
from GitHub. jaxops builds no Java; these forwarders let the build run offline.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
