#!/usr/bin/env python3
"""Finds import cycles in a Python package: between its subpackages, and between its modules.

    python scripts/import_cycles.py            # hfjax/; exit 1 on any cycle, naming it
    python scripts/import_cycles.py ROOT_DIR   # another package directory

Every import counts, wherever it sits: a lazy import inside a function still ties the two modules
together (each needs the other to exist and to be importable in either order), so the project
keeps none. Two levels are checked:

- package: hfjax.<a> and hfjax.<b> (with everything under them) import each other, through any
  modules, which Bazel refuses between targets (scripts/bazel_build.py);
- module: two or more modules import each other (in one package or across packages). A module
  importing the `__init__` of a package it sits in is not an edge: that is how Python loads it.

`from pkg import name` is an import of `pkg.name` when that is a module, else of `pkg` itself.
tests/test_import_cycles.py runs this over hfjax/ in the suite.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path


def module_files(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module under the package directory `root`; a
    package is named by its `__init__.py`."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imported_names(tree: ast.AST, package: str) -> Iterable[str]:
    """Every dotted name an import statement anywhere in `tree` may refer to (a module, or a
    module's attribute), relative imports resolved against `package`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level - 1 > len(parts) - 1:
                    continue  # beyond the top package: nothing of ours
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            yield base
            for alias in node.names:
                yield f"{base}.{alias.name}"


def module_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """{module: the modules of `modules` it imports}, without edges to its own packages."""
    edges: dict[str, set[str]] = {}
    for name, f in modules.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for dotted in _imported_names(ast.parse(f.read_text(), str(f)), package):
            if dotted in modules and dotted != name and not name.startswith(dotted + "."):
                targets.add(dotted)
        edges[name] = targets
    return edges


def package_graph(edges: Mapping[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    """{subpackage: the subpackages it imports}, a subpackage being a package directly under the
    top one (`hfjax.engine.hybrid` is in `engine`); `packages` names the packages among the
    modules. Modules directly in the top package belong to none."""

    def sub(name: str) -> str | None:
        parts = name.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and name in packages) else None

    out: dict[str, set[str]] = {}
    for a, targets in edges.items():
        for b in targets:
            pa, pb = sub(a), sub(b)
            if pa and pb and pa != pb:
                out.setdefault(pa, set()).add(pb)
    return out


def _bazel_build():
    """scripts/bazel_build.py, whose Tarjan's algorithm (`Generator.components`) finds the
    package cycles Bazel refuses; loaded by path, as scripts/ is no package."""
    if "bazel_build" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "bazel_build", Path(__file__).resolve().with_name("bazel_build.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while decorating
        spec.loader.exec_module(module)
    return sys.modules["bazel_build"]


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The cycles of a directed graph: its strongly connected components of two or more nodes,
    each sorted, in sorted order."""
    return [c for c in _bazel_build().Generator.components(edges) if len(c) > 1]


def cycles(root: Path) -> tuple[list[list[str]], list[list[str]]]:
    """(package cycles, module cycles) of the package directory `root`."""
    modules = module_files(root)
    packages = {n for n, f in modules.items() if f.name == "__init__.py"}
    edges = module_graph(modules)
    return strongly_connected(package_graph(edges, packages)), strongly_connected(edges)


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "hfjax")
    if not (root / "__init__.py").exists():
        print(f"{root} is not a package directory (no __init__.py); run from the project root "
              "or name the package directory", file=sys.stderr)
        return 2
    packages, modules = cycles(root)
    for kind, found in (("package", packages), ("module", modules)):
        for c in found:
            print(f"{kind} cycle: {' <-> '.join(c)}")
    if not packages and not modules:
        print(f"{root}: no import cycles")
    return 1 if packages or modules else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
