"""The suite's order (tests/conftest.py, support.longest_first): the modules it runs first
exist, the longest work comes first (the longest modules and the smoke tier's parts, by their
`seconds` marks), each module's tests in their own order, and pytest-xdist hands the units of
work out in that order."""

import os
import pathlib
import types

import pytest
from support import LONGEST_MODULES, longest_first

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_longest_modules_exist():
    stale = sorted(p for p in LONGEST_MODULES if not os.path.isfile(os.path.join(ROOT, p)))
    assert not stale, f"LONGEST_MODULES names modules that are gone: {stale}"


def _item(path: str, n: int, seconds: float | None = None):
    marks = {} if seconds is None else {"seconds": pytest.mark.seconds(seconds).mark}
    return types.SimpleNamespace(path=pathlib.Path(ROOT, path), n=n,
                                 get_closest_marker=marks.get)


def test_the_longest_work_comes_first():
    a, b = min(LONGEST_MODULES, key=LONGEST_MODULES.get), max(LONGEST_MODULES,
                                                              key=LONGEST_MODULES.get)
    between = (LONGEST_MODULES[a] + LONGEST_MODULES[b]) / 2
    doc = "tests/test_documented_commands.py"
    items = [_item("tests/x/test_short.py", 0), _item(a, 1), _item(doc, 2, between),
             _item(b, 3), _item(a, 4), _item(doc, 5, 10 * LONGEST_MODULES[b])]
    assert [i.n for i in longest_first(items, ROOT)] == [5, 3, 2, 1, 4, 0]


def test_xdist_hands_the_work_out_in_the_suite_s_order(pytestconfig):
    """Without --no-loadscope-reorder (pyproject.toml's addopts), pytest-xdist re-sorts its
    units of work by their number of tests, and a long module of few tests (the cross-process
    ones) or a smoke-tier part (one test) starts last and runs alone at the end."""
    assert pytestconfig.getoption("loadscopereorder") is False


def test_each_module_is_one_unit_of_work(request):
    """tests/conftest.py puts a test without an `xdist_group` mark in its module's group."""
    mark = request.node.get_closest_marker("xdist_group")
    assert mark is not None and mark.args[0] == "tests/test_suite_order.py"
