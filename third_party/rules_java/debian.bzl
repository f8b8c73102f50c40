"""`@rules_java` from Debian's `bazel-rules-java` package, located through dpkg.

Bazel 4.2.3 registers its Java toolchains (`@bazel_tools//tools/jdk:all`) for every build, and
their BUILD file loads `@rules_java//java:defs.bzl`, which would otherwise be downloaded. Debian
ships a copy that works with 4.2.3; asking dpkg where it lives keeps WORKSPACE free of a path
that packaging may move, and lets a missing package fail with the command that installs it.
"""

_PACKAGE = "bazel-rules-java"
_INSTALL = "sudo apt-get install bazel-rules-java (or run scripts/bazel_test.sh, which does)"

def _debian_rules_java_impl(rctx):
    listing = rctx.execute(["dpkg", "-L", _PACKAGE])
    if listing.return_code != 0:
        fail("@rules_java comes from Debian's %s package, which is not installed: %s" %
             (_PACKAGE, _INSTALL))

    # The package's root is the directory that holds java/defs.bzl.
    roots = [
        line[:-len("/java/defs.bzl")]
        for line in listing.stdout.splitlines()
        if line.endswith("/java/defs.bzl")
    ]
    if len(roots) != 1:
        fail("dpkg -L %s lists %d java/defs.bzl files, expected exactly 1; reinstall it: %s" %
             (_PACKAGE, len(roots), _INSTALL))

    # A repository's root cannot itself be a symlink, so each entry is linked one by one.
    for entry in rctx.path(roots[0]).readdir():
        rctx.symlink(entry, entry.basename)

debian_rules_java = repository_rule(
    implementation = _debian_rules_java_impl,
    local = True,
    doc = "Links the rules_java tree installed by Debian's bazel-rules-java package.",
)
