"""No import cycles in hfjax/ (scripts/import_cycles.py): neither between its subpackages nor
between its modules, lazy imports inside functions included, so a new one fails CI."""

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

# Under Bazel this file is a symlink into the checkout; the check reads the checkout itself,
# since a test's runfiles hold only the files its target declares.
ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts/import_cycles.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ic = _load_script()


def test_hfjax_has_no_import_cycles():
    packages, modules = ic.cycles(ROOT / "hfjax")
    assert packages == [], f"hfjax subpackages import each other: {packages}"
    assert modules == [], (
        f"hfjax modules import each other (lazy imports count): {modules}; give the names they "
        "share one home in a module below both")


def _package(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


def test_finds_lazy_relative_and_package_cycles(tmp_path):
    root = _package(tmp_path, {
        "pkg/__init__.py": "",
        # A module cycle through a lazy import and a relative one.
        "pkg/a/__init__.py": "from pkg.a import x\n",
        "pkg/a/x.py": """
            import pkg.a  # its own package: not an edge

            def f():
                from pkg.a import y
                return y
            """,
        "pkg/a/y.py": "from . import x\n",
        # A package cycle whose modules form no cycle: b.m -> c.n, c.k -> b.j.
        "pkg/b/__init__.py": "",
        "pkg/b/m.py": "import pkg.c.n\n",
        "pkg/b/j.py": "",
        "pkg/c/__init__.py": "",
        "pkg/c/n.py": "",
        "pkg/c/k.py": "from ..b.j import *\n",
        # A name imported from a package that is not a module is an import of the package.
        "pkg/d/__init__.py": "VALUE = 1\n",
        "pkg/d/z.py": "from pkg.d import VALUE\n",
    })
    packages, modules = ic.cycles(root)
    assert packages == [["b", "c"]]
    assert modules == [["pkg.a.x", "pkg.a.y"]]
    run = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True,
                         text=True, check=False)
    assert run.returncode == 1
    assert "package cycle: b <-> c" in run.stdout
    assert "module cycle: pkg.a.x <-> pkg.a.y" in run.stdout
