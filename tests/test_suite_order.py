"""The suite's order (tests/conftest.py, support.longest_first): the modules it runs first
exist, and they come first, longest first, each module's tests in their own order."""

import os
import pathlib
import types

from support import LONGEST_MODULES, longest_first

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_longest_modules_exist():
    stale = sorted(p for p in LONGEST_MODULES if not os.path.isfile(os.path.join(ROOT, p)))
    assert not stale, f"LONGEST_MODULES names modules that are gone: {stale}"


def test_the_longest_modules_come_first_longest_first():
    a, b = sorted(LONGEST_MODULES, key=LONGEST_MODULES.get)[:2]  # b is the longer
    names = ["tests/x/test_short.py", a, "tests/y/test_other.py", b, a]
    items = [types.SimpleNamespace(path=pathlib.Path(ROOT, p), n=i) for i, p in enumerate(names)]
    want = [3, 1, 4, 0, 2] if LONGEST_MODULES[b] > LONGEST_MODULES[a] else [1, 3, 4, 0, 2]
    assert [i.n for i in longest_first(items, ROOT)] == want
