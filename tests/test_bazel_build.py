"""The Bazel build: its BUILD files agree with the sources' imports (scripts/bazel_build.py
writes them), and its pytest runner (tests/pytest_main.py) shards a module as Bazel asks.

A module move that changes which package imports which (issue 12 moves `transfer`,
`WorkerGroup` and the RL numerics) fails here with the list of stale BUILD files, or with the
import cycle Bazel would refuse, instead of failing later inside `bazel test`.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

# Under Bazel this file is a symlink into the checkout; the check reads the checkout itself,
# since a test's runfiles hold only the files its target declares.
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("bazel_build", ROOT / "scripts/bazel_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


bb = _load_script()


def test_build_files_match_the_imports():
    try:
        bad = bb.stale(ROOT)
    except bb.BuildError as e:
        pytest.fail(f"scripts/bazel_build.py cannot describe the sources: {e}")
    assert not bad, (
        f"BUILD files out of date with the sources' imports: {', '.join(bad)}. "
        "Run `python scripts/bazel_build.py` and commit what it writes."
    )


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return root


# A miniature checkout: packages p and q import each other, r imports p, an entry point and a
# test that runs it as a subprocess.
CYCLE = {
    "hfjax/__init__.py": "",
    "hfjax/p/__init__.py": "",
    "hfjax/p/one.py": "from hfjax.q import two\n",
    "hfjax/q/__init__.py": "",
    "hfjax/q/two.py": "from hfjax.p import one\n",
    "hfjax/r/__init__.py": "from hfjax.p.one import two\n",
    "hfjax/top.py": "from hfjax import r\n",
    "configs/__init__.py": "",
    "launch/__init__.py": "",
    "launch/run.py": "import hfjax.top\nif __name__ == '__main__':\n    pass\n",
    "tests/conftest.py": "",
    "tests/r/test_r.py": "import subprocess\nimport hfjax.r\nCMD = ['-m', 'launch.run']\n",
}


def _labels(text: str) -> list[str]:
    return re.findall(r'"((?://|:)[^"]*)"', text)


def _mini_tables(monkeypatch) -> None:
    """The tables of scripts/bazel_build.py for the miniature checkout CYCLE."""
    monkeypatch.setattr(bb, "TEST_OPTIONS", {})
    monkeypatch.setattr(bb, "CI_TESTS", {"tests/r/test_r.py"})
    monkeypatch.setattr(bb, "CI_EXEMPT", {})


def test_a_listed_cycle_shares_one_target_in_the_common_ancestor(tmp_path, monkeypatch):
    monkeypatch.setattr(bb, "KNOWN_CYCLES", [frozenset({"hfjax.p", "hfjax.q"})])
    _mini_tables(monkeypatch)
    out = bb.generate(_tree(tmp_path, CYCLE))
    assert sorted(out) == ["configs/BUILD", "hfjax/BUILD", "hfjax/r/BUILD", "launch/BUILD",
                           "tests/BUILD", "tests/r/BUILD"]
    hfjax = out["hfjax/BUILD"]
    assert 'name = "p_q"' in hfjax
    assert 'srcs = glob([\n        "p/*.py",\n        "q/*.py",\n    ])' in hfjax
    # The parent's __init__ is its own target, so the cycle's target need not pull in top.py.
    assert 'name = "init"' in hfjax and 'exclude = ["__init__.py"]' in hfjax
    assert "//hfjax:p_q" in _labels(out["hfjax/r/BUILD"])
    test_build = out["tests/r/BUILD"]
    assert "//hfjax/r" in _labels(test_build) and "//launch:run" in _labels(test_build)
    assert "//tests:conftest" in _labels(test_build)


def test_an_unlisted_cycle_is_refused_with_the_imports_that_form_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bb, "KNOWN_CYCLES", [])
    _mini_tables(monkeypatch)
    with pytest.raises(bb.BuildError, match="hfjax.p, hfjax.q import each other") as e:
        bb.generate(_tree(tmp_path, CYCLE))
    assert "hfjax/p/one.py:1" in str(e.value) and "hfjax/q/two.py:1" in str(e.value)


def test_once_the_cycle_is_gone_each_package_gets_its_own_target(tmp_path, monkeypatch):
    moved = CYCLE | {"hfjax/q/two.py": "X = 2\n"}
    _mini_tables(monkeypatch)
    monkeypatch.setattr(bb, "KNOWN_CYCLES", [frozenset({"hfjax.p", "hfjax.q"})])
    with pytest.raises(bb.BuildError, match="no longer import each other: delete that entry"):
        bb.generate(_tree(tmp_path, moved))
    monkeypatch.setattr(bb, "KNOWN_CYCLES", [])
    out = bb.generate(tmp_path)
    assert {"hfjax/p/BUILD", "hfjax/q/BUILD"} <= set(out)
    assert "//hfjax/q" in _labels(out["hfjax/p/BUILD"])
    assert "//hfjax/p" not in _labels(out["hfjax/q/BUILD"])


def test_an_import_of_a_missing_module_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(bb, "KNOWN_CYCLES", [frozenset({"hfjax.p", "hfjax.q"})])
    _mini_tables(monkeypatch)
    broken = CYCLE | {"hfjax/r/__init__.py": "from hfjax.gone import thing\n"}
    with pytest.raises(bb.BuildError, match=r"hfjax/r/__init__.py:1 imports hfjax.gone"):
        bb.generate(_tree(tmp_path, broken))


def test_ci_tests_are_tagged_and_every_test_package_has_one(tmp_path, monkeypatch):
    _mini_tables(monkeypatch)
    tree = _tree(tmp_path, CYCLE | {"hfjax/q/two.py": "X = 2\n",
                                    "tests/s/test_s.py": "import hfjax.q\n"})
    with pytest.raises(bb.BuildError, match=r"tests/s: no test module of it is in CI_TESTS"):
        bb.generate(tree)
    monkeypatch.setattr(bb, "CI_EXEMPT", {"tests/s": "a reason"})
    out = bb.generate(tree)
    tagged = re.search(r'name = "test_r",.*?tags = \[(.*?)\]', out["tests/r/BUILD"], re.S)
    assert tagged and '"ci"' in tagged.group(1)
    assert "tags" not in out["tests/s/BUILD"]
    monkeypatch.setattr(bb, "CI_TESTS", {"tests/r/test_gone.py"})
    with pytest.raises(bb.BuildError, match="CI_TESTS .* names missing test modules"):
        bb.generate(tree)


def test_the_checkout_s_ci_targets_are_cheap_modules_of_the_suite():
    """What CI runs under Bazel is a subset of the modules, never one that TEST_OPTIONS makes
    large (those are the suite's long modules)."""
    assert bb.CI_TESTS and all((ROOT / m).is_file() for m in bb.CI_TESTS)
    heavy = sorted(m for m in bb.CI_TESTS
                   if bb.TEST_OPTIONS.get(m, {}).get("size", "medium") not in ("small", "medium"))
    assert not heavy, f"CI_TESTS holds large modules: {heavy}"


def _run_shard(tmp_path, module, total: int, index: int) -> tuple[int, list[str], bool]:
    """Runs tests/pytest_main.py on `module` as shard `index` of `total`, the way Bazel does;
    returns its exit status, the tests it ran and whether it told Bazel it shards."""
    work = tmp_path / f"shard_{index}_of_{total}"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TEST_") and k != "XML_OUTPUT_FILE"}  # this test's own, if any
    env |= {"TEST_TOTAL_SHARDS": str(total), "TEST_SHARD_INDEX": str(index),
            "TEST_SHARD_STATUS_FILE": str(work / "status"), "TEST_TMPDIR": str(work),
            "XML_OUTPUT_FILE": str(work / "test.xml")}
    p = subprocess.run([sys.executable, str(ROOT / "tests/pytest_main.py"), str(module)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    ran = [case.get("name") for case in ET.parse(work / "test.xml").getroot().iter("testcase")]
    return p.returncode, ran, (work / "status").exists()


def test_shards_run_disjoint_contiguous_blocks_that_cover_the_module(tmp_path):
    module = tmp_path / "test_five.py"
    module.write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(5)))
    runs = [_run_shard(tmp_path, module, 2, i) for i in range(2)]
    assert [code for code, _, _ in runs] == [0, 0]
    assert [ran for _, ran, _ in runs] == [["test_0", "test_1"], ["test_2", "test_3", "test_4"]]
    assert all(told for _, _, told in runs)


def test_a_shard_left_without_tests_passes(tmp_path):
    module = tmp_path / "test_two.py"
    module.write_text("def test_a():\n    pass\n\n\ndef test_b():\n    assert False\n")
    assert _run_shard(tmp_path, module, 3, 0)[:2] == (0, [])
    assert _run_shard(tmp_path, module, 3, 2)[:2] == (1, ["test_b"])
