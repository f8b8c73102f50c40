"""Runs one test module under pytest as a Bazel `py_test` (see tests/pytest.bzl).

    pytest_main.py tests/models/test_hf_parity.py

Bazel starts it with the runfiles tree as the working directory, which is laid out like the
repository, so pytest finds pyproject.toml (markers, options) and the conftest.py files there
exactly as it does in a checkout. On top of plain `pytest`:
- Bazel's test sharding (TEST_TOTAL_SHARDS, TEST_SHARD_INDEX): each shard runs one contiguous
  block of the module's tests in pytest's order. pytest orders tests so that the users of a
  module-scoped fixture sit next to each other, so a block boundary splits few of them and the
  expensive fixtures are rarely built twice.
- per-test results go to Bazel's XML_OUTPUT_FILE, and pytest's temporary directories to
  TEST_TMPDIR, which Bazel gives each test (and each shard) to itself;
- a check that `hfjax` was imported from the runfiles and not from an editable install of some
  other checkout, so that a Bazel run really tests the sources Bazel built.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest


class _BazelPlugin:
    """Selects this shard's block of tests and checks where the first-party code came from."""

    def __init__(self, total: int, index: int):
        self.total, self.index = total, index
        self.shard_is_empty = False

    def pytest_collection_modifyitems(self, config, items):
        if self.total <= 1:
            return
        n = len(items)
        lo, hi = n * self.index // self.total, n * (self.index + 1) // self.total
        keep = items[lo:hi]
        config.hook.pytest_deselected(items=items[:lo] + items[hi:])
        items[:] = keep
        self.shard_is_empty = not keep

    def pytest_collection_finish(self, session):
        runfiles = pathlib.Path(os.environ.get("TEST_SRCDIR", os.getcwd())).resolve()
        for name in ("hfjax", "launch", "configs"):
            module = sys.modules.get(name)
            origin = getattr(module, "__file__", None)
            # The runfiles tree is made of real directories holding symlinks to the sources:
            # resolve the directory, not the file, which would lead back into the checkout.
            if origin and runfiles not in pathlib.Path(origin).parent.resolve().parents:
                pytest.exit(
                    f"{name} was imported from {origin}, outside Bazel's runfiles ({runfiles}): "
                    "a path in PYTHONPATH or a .pth file shadows the sources under test; "
                    "remove it from the test environment",
                    returncode=pytest.ExitCode.USAGE_ERROR,
                )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: {sys.argv[0]} TEST_MODULE.py", file=sys.stderr)
        return 2
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    index = int(os.environ.get("TEST_SHARD_INDEX", "0"))
    if "TEST_TMPDIR" in os.environ:
        # The sandbox's home is read-only: libraries that keep a cache there (matplotlib, which
        # reasoning-gym imports) would warn on stderr, in the one-line errors tests check.
        os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.environ["TEST_TMPDIR"], "mpl"))
    if "TEST_SHARD_STATUS_FILE" in os.environ:
        # Tells Bazel that this runner honours sharding (otherwise every shard would run all).
        pathlib.Path(os.environ["TEST_SHARD_STATUS_FILE"]).touch()

    args = [argv[0], "-p", "no:cacheprovider"]  # the runfiles tree is not ours to write into
    if "TEST_TMPDIR" in os.environ:
        args.append(f"--basetemp={os.path.join(os.environ['TEST_TMPDIR'], 'pytest')}")
    if "XML_OUTPUT_FILE" in os.environ:
        args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")

    plugin = _BazelPlugin(total, index)
    code = pytest.main(args, plugins=[plugin])
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and plugin.shard_is_empty:
        return 0  # more shards than tests: an empty shard has nothing to fail
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
