#!/usr/bin/env python3
"""Writes hfjax's Bazel BUILD files from the imports in the sources, or checks them.

    python scripts/bazel_build.py            # (re)write the BUILD files
    python scripts/bazel_build.py --check    # exit 1, naming every BUILD file that is stale

Bazel wants every import between first-party packages declared as a dependency, and refuses
cycles between targets; Python needs neither, so hand-written BUILD files drift each time a
module moves. This script derives them from the code:

- hfjax/, configs/: a py_library per Python package (a glob of its modules) that depends on every
  first-party package its modules import. A package with subpackages splits its __init__.py off
  as `:init`, which the subpackages need without also pulling in the parent's other modules
  (hfjax/run/trainer.py imports every subpackage).
- Packages that import each other share one py_library, declared in the BUILD file of their
  closest common ancestor, but only while they are listed in KNOWN_CYCLES: any other cycle is an
  error that names the imports forming it.
- launch/: a py_binary per entry point (a module with a `__main__` guard).
- tests/: a pytest_test (tests/pytest.bzl) per test_*.py module, a py_library per conftest.py and
  per helper module (such as hf_fixtures.py).

A string constant that is exactly the name of a first-party module or package ("launch.train" in
`python -m launch.train`, "configs" in a path join) is a dependency too: the code runs or reads it
at run time. A launch/ entry point named this way from a test or a test helper becomes its `data`;
a test helper's module name (a file a test hands to a subprocess by path) makes the helper a
dependency.

tests/test_bazel_build.py fails when the checked-in BUILD files differ from what this writes.

One file past 600 lines: the import scan, the rules that turn imports into targets and the
writer are one pass over one model of the tree (`Target`), and a reader changing a rule wants
the scan and the output beside it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys
from collections.abc import Iterable
from pathlib import Path

LIBRARY_ROOTS = ("hfjax", "configs")
BINARY_ROOT = "launch"
TESTS = "tests"
RUNNER = "pytest_main.py"  # tests/pytest.bzl runs every test module through it

# Package cycles that are tolerated for now, each as the set of packages in it. Their packages
# share one py_library until the cycle is gone; this script then fails until the entry is deleted,
# so that the packages get their own targets again. Issue 12 removes this one (the controller's
# `transfer` moves to hfjax/parallel/transfer.py, WorkerGroup to hfjax/workers/).
KNOWN_CYCLES: list[frozenset[str]] = []

# Test modules that need more than the defaults. Size "medium" (a 300 s timeout per shard) is
# for modules that take under ~20 s on a quiet 2-core machine; the rest are "large" (1800 s,
# .bazelrc), since a loaded machine stretches them up to ten times. CI runs the small and
# medium ones (scripts/bazel_test.sh --test_size_filters=small,medium). Shards split a module
# into contiguous blocks of tests (tests/pytest_main.py); with two cores, two shards let Bazel
# run the halves of the longest modules side by side.
TEST_OPTIONS: dict[str, dict] = {
    "tests/engine/test_continuous.py": {"size": "large", "shard_count": 2},
    "tests/engine/test_hybrid.py": {"size": "large", "shard_count": 2},
    "tests/engine/test_packing.py": {"size": "large", "shard_count": 2},
    "tests/engine/test_sampler.py": {"size": "large", "shard_count": 2},
    "tests/models/test_gguf_io.py": {"size": "large"},
    "tests/models/test_hf_parity.py": {"size": "large"},
    "tests/models/test_smollm2.py": {"size": "large"},
    "tests/models/test_tokenizer.py": {"size": "large"},
    # One module fixture saves the checkpoint that most of its tests restore: not sharded.
    "tests/run/test_checkpoint.py": {"size": "large"},
    # One module fixture runs the uninterrupted job that its tests compare with: not sharded.
    "tests/run/test_resume.py": {"size": "large"},
    "tests/run/test_rl_loop.py": {"size": "large", "shard_count": 2},
    # Real multi-process training runs and whole-run compilations.
    "tests/run/test_trainer_processes.py": {"size": "large"},
    "tests/run/test_dry_run.py": {"size": "large"},
    # A real training run writing its log to a file.
    "tests/run/test_train_log.py": {"size": "large"},
    # A training run and its resume through launch.train, read back by W&B's and MLflow's readers.
    "tests/run/test_trackers.py": {"size": "large"},
    # Three LoRA runs exported (four launch.export processes) and loaded by PEFT.
    "tests/models/test_lora_export.py": {"size": "large"},
    "tests/models/test_sequence_parallel_hlo.py": {"size": "large"},
    "tests/run/test_async_partial.py": {"size": "large"},
    "tests/run/test_async_rollout.py": {"size": "large"},
    # The smoke tier runs every command of README.md and docs/ (files outside the runfiles) in
    # a scratch copy of the checkout: pytest runs it (-m smoke, .ci/run), Bazel only on request.
    "tests/test_documented_commands.py": {"size": "enormous",
                                          "tags": ["manual", "external", "local"]},
    # It reads the source tree (not the runfiles, which hold only declared files), so Bazel must
    # neither sandbox it nor cache its result, which depends on files it does not declare.
    "tests/test_bazel_build.py": {"tags": ["external", "local"]},
    # These read the checkout beside the runfiles (bench/ as a process; docs/scaling.md's table).
    "tests/test_bench_accelerator.py": {"size": "large", "tags": ["external", "local"]},
    "tests/test_bench_builds.py": {"tags": ["external", "local"]},
    "tests/planner/test_search.py": {"tags": ["external", "local"]},
    # Runs docs/agents.md's examples, read from the checkout.
    "tests/tools/test_docs_examples.py": {"tags": ["external", "local"]},
}

# Test modules that CI runs under Bazel (tagged "ci"): a few cheap ones per package of tests/,
# chosen to go through every Bazel mechanism (the toolchain, runfiles, conftest and helper
# libraries, launch/ binaries run as subprocesses, tool and reward worker processes importing
# hfjax from the runfiles). CI builds every target and runs only these
# (`scripts/bazel_test.sh --test_tag_filters=ci //...`); the pytest suite runs every module
# already, so Bazel does not run them a second time.
CI_TESTS: set[str] = {
    "tests/test_bazel_build.py",
    "tests/config/test_key_declarations.py",
    "tests/controller/test_placement.py",
    "tests/data/test_dataset.py",
    "tests/data/test_prepare_data.py",  # a launch/ binary from the runfiles
    "tests/engine/test_layout_choice.py",
    "tests/engine/test_update_schedule.py",
    "tests/models/test_load_errors.py",  # the hf_fixtures helper library
    "tests/numerics/test_numerics.py",
    "tests/parallel/test_mesh.py",
    "tests/parallel/test_targets.py",
    "tests/planner/test_config.py",
    "tests/rewards/test_rule_reward.py",  # reward scorer processes
    "tests/rewards/test_math_rewards.py",
    "tests/run/test_metrics.py",
    "tests/tools/test_calculator.py",
    "tests/tools/test_parse.py",
    "tests/tools/test_docs_examples.py",  # tool worker processes
    "tests/workers/test_spec.py",
}
# Packages of tests/ without a CI_TESTS module, with the reason.
CI_EXEMPT: dict[str, str] = {
    "tests/agents": "its one module decodes multi-turn rollouts (over 3 min under Bazel on the "
                    "loaded machine); tests/tools/test_docs_examples.py starts tool workers",
    "tests/algorithms": "every module trains an algorithm (minutes under Bazel); the pytest "
                        "suite runs them",
}

HEADER = (
    "# Generated by scripts/bazel_build.py from the imports in the sources: after moving code,\n"
    "# run `python scripts/bazel_build.py` instead of editing this file.\n"
)


class BuildError(Exception):
    """The sources cannot be described by BUILD files as they are; the message says why."""


@dataclasses.dataclass(frozen=True)
class Ref:
    """A first-party name that a file refers to, and where."""

    name: str
    file: str
    line: int
    is_import: bool


@dataclasses.dataclass(frozen=True, order=True)
class Node:
    """A unit of the package graph: a package's modules ("lib") or its lone __init__ ("init")."""

    package: str
    kind: str = "lib"


@dataclasses.dataclass
class Target:
    """A BUILD rule as it will be written."""

    rule: str
    directory: str
    name: str
    attrs: dict


class Glob:
    """A glob(...) expression in a BUILD file."""

    def __init__(self, include: list[str], exclude: list[str] | None = None):
        self.include, self.exclude = include, exclude or []


def _dotted(path: str) -> str:
    return path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def _has_main_guard(tree: ast.Module) -> bool:
    for stmt in tree.body:
        if isinstance(stmt, ast.If) and "__main__" in ast.unparse(stmt.test):
            return True
    return False


class Sources:
    """The first-party Python files of a checkout, and the first-party names each refers to."""

    def __init__(self, root: Path):
        self.root = root
        self.packages: dict[str, str] = {}  # dotted name -> directory (relative, "/"-separated)
        self.modules: dict[str, str] = {}  # dotted name -> file
        self.trees: dict[str, ast.Module] = {}
        for top in (*LIBRARY_ROOTS, BINARY_ROOT):
            for directory, subdirs, files in os.walk(root / top):
                subdirs[:] = sorted(d for d in subdirs if not d.startswith((".", "__")))
                rel = Path(directory).relative_to(root).as_posix()
                if "__init__.py" not in files:
                    subdirs[:] = []  # a plain directory below a package is not importable
                    continue
                self.packages[_dotted(rel + "/__init__.py")] = rel
                for f in sorted(files):
                    if f.endswith(".py"):
                        self.modules[_dotted(f"{rel}/{f}")] = f"{rel}/{f}"
        self.tops = {name.split(".")[0] for name in self.packages}

    def tree(self, file: str) -> ast.Module:
        if file not in self.trees:
            self.trees[file] = ast.parse((self.root / file).read_text(), filename=file)
        return self.trees[file]

    def exists(self, name: str) -> bool:
        return name in self.packages or name in self.modules

    def refs(self, file: str, local: Iterable[str] = ()) -> list[Ref]:
        """First-party modules and packages `file` imports or names; `local` are extra top-level
        names (test helpers imported through sys.path) that count as first-party."""
        local = set(local)
        # The package that relative imports start from (__init__.py's own package).
        package = _dotted(file)
        if not file.endswith("__init__.py"):
            package = package.rsplit(".", 1)[0]
        out: list[Ref] = []

        def add(name: str, node: ast.AST, is_import: bool) -> None:
            out.append(Ref(name, file, node.lineno, is_import))

        for node in ast.walk(self.tree(file)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    if top in self.tops or top in local:
                        add(alias.name, node, True)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                top = module.split(".")[0]
                if top in local:
                    add(module, node, True)
                elif top in self.tops:
                    # `from hfjax.run import metrics` imports the module hfjax.run.metrics;
                    # `from hfjax.engine import Sampler` imports the package hfjax.engine.
                    subs = [f"{module}.{a.name}" for a in node.names]
                    found = [s for s in subs if self.exists(s)]
                    for name in found or [module]:
                        add(name, node, True)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if self.exists(node.value) or node.value in local:
                    add(node.value, node, False)
        return out

    def check_exists(self, ref: Ref) -> None:
        if ref.is_import and not self.exists(ref.name):
            raise BuildError(f"{ref.file}:{ref.line} imports {ref.name}, which does not exist")


class Generator:
    """Works out the targets of every generated BUILD file."""

    def __init__(self, root: Path):
        self.src = Sources(root)
        self.root = root
        pk = self.src.packages
        self.split = {p for p in pk if any(q.startswith(p + ".") for q in pk)}
        self.entry_points = {
            name: file for name, file in self.src.modules.items()
            if name.startswith(BINARY_ROOT + ".") and _has_main_guard(self.src.tree(file))
        }

    # -- the package graph -------------------------------------------------------------------

    def node_of_file(self, file: str) -> Node:
        name = _dotted(file)
        if file.endswith("__init__.py"):
            return Node(name, "init" if name in self.split else "lib")
        return Node(name.rsplit(".", 1)[0])

    def node_of_name(self, name: str) -> Node:
        if name in self.src.packages:
            return Node(name, "init" if name in self.split else "lib")
        return Node(name.rsplit(".", 1)[0])

    def library_graph(self) -> dict[Node, dict[Node, Ref | None]]:
        """Edges between library nodes, each with one reference that causes it (None when
        implied by the package structure)."""
        graph: dict[Node, dict[Node, Ref | None]] = {}
        for name, file in self.src.modules.items():
            if name in self.entry_points:
                continue
            node = self.node_of_file(file)
            edges = graph.setdefault(node, {})
            parent = node.package.rsplit(".", 1)[0] if "." in node.package else None
            if parent:
                edges.setdefault(Node(parent, "init"), None)
            if node.kind == "lib" and node.package in self.split:
                edges.setdefault(Node(node.package, "init"), None)
            for ref in self.src.refs(file):
                self.src.check_exists(ref)
                if ref.name in self.entry_points:
                    raise BuildError(f"{ref.file}:{ref.line}: library code refers to the entry "
                                     f"point {ref.name}; move what it needs into hfjax/")
                target = self.node_of_name(ref.name)
                if target != node:
                    edges.setdefault(target, ref)
        return graph

    @staticmethod
    def components(graph: dict[Node, dict[Node, Ref | None]]) -> list[list[Node]]:
        """Strongly connected components (Tarjan), each sorted, in a stable order."""
        index: dict[Node, int] = {}
        low: dict[Node, int] = {}
        stack: list[Node] = []
        on_stack: set[Node] = set()
        out: list[list[Node]] = []

        def visit(v: Node) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            on_stack.add(v)
            for w in sorted(graph.get(v, {})):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))

        for v in sorted(graph):
            if v not in index:
                visit(v)
        return sorted(out)

    def check_cycles(self, graph, comps: list[list[Node]]) -> None:
        cycles = [c for c in comps if len(c) > 1]
        found = {frozenset(n.package for n in c) for c in cycles}
        for comp in cycles:
            packages = frozenset(n.package for n in comp)
            if packages not in KNOWN_CYCLES:
                members = set(comp)
                why = "\n".join(
                    f"  {ref.file}:{ref.line} ({a.package} -> {b.package}: {ref.name})"
                    for a in comp for b, ref in sorted(graph[a].items())
                    if b in members and ref is not None
                )
                raise BuildError(
                    f"packages {', '.join(sorted(packages))} import each other, and Bazel "
                    f"refuses cycles between targets. Break the cycle (move what both need into "
                    f"a package that imports neither); the imports that form it:\n{why}"
                )
        for known in KNOWN_CYCLES:
            if known not in found:
                raise BuildError(
                    f"{', '.join(sorted(known))} no longer import each other: delete that entry "
                    f"from KNOWN_CYCLES in scripts/bazel_build.py, so that each gets its own "
                    f"py_library, and run the script again"
                )

    # -- targets --------------------------------------------------------------------------

    def targets(self) -> list[Target]:
        graph = self.library_graph()
        comps = self.components(graph)
        self.check_cycles(graph, comps)

        # A package merged into a cycle's target has no BUILD file of its own; its files belong
        # to the package of the cycle's closest common ancestor directory.
        pkg_dir = self.src.packages
        absorbed: set[str] = set()
        home: dict[int, str] = {}
        for i, comp in enumerate(comps):
            dirs = sorted({pkg_dir[n.package] for n in comp})
            common = os.path.commonpath(dirs) if len(dirs) > 1 else dirs[0]
            home[i] = common
            absorbed |= {d for d in dirs if d != common}

        def build_dir(directory: str) -> str:
            while directory in absorbed:
                directory = directory.rsplit("/", 1)[0]
            return directory

        def node_name(node: Node, where: str) -> str:
            rel = os.path.relpath(pkg_dir[node.package], where)
            base = node.package.rsplit(".", 1)[-1] if rel == "." else rel.replace("/", "_")
            if node.kind == "init":
                return "init" if rel == "." else f"{base}_init"
            return base

        def node_srcs(node: Node, where: str) -> Glob | list[str]:
            rel = os.path.relpath(pkg_dir[node.package], where)
            prefix = "" if rel == "." else rel + "/"
            if node.kind == "init":
                return [f"{prefix}__init__.py"]
            exclude = [f"{prefix}__init__.py"] if node.package in self.split else []
            entries = [f"{prefix}{Path(f).name}" for n, f in self.entry_points.items()
                       if self.node_of_file(f) == node]
            return Glob([f"{prefix}*.py"], exclude + entries)

        label_of: dict[Node, tuple[str, str]] = {}
        out: list[Target] = []
        for i, comp in enumerate(comps):
            where = build_dir(home[i])
            names = [node_name(n, where) for n in comp]
            name = names[0] if len(comp) == 1 else "_".join(names)
            for n in comp:
                label_of[n] = (where, name)
            srcs: list = [node_srcs(n, where) for n in comp]
            glob = Glob([p for s in srcs if isinstance(s, Glob) for p in s.include],
                        [p for s in srcs if isinstance(s, Glob) for p in s.exclude])
            files = [p for s in srcs if isinstance(s, list) for p in s]
            if glob.include and files:
                raise BuildError(f"cannot lay out the cycle {names}: it mixes a package's "
                                 "__init__.py with another package's modules")
            out.append(Target("py_library", where, name,
                              {"srcs": glob if glob.include else files, "_nodes": comp}))

        def label(node: Node, where: str) -> str:
            d, n = label_of[node]
            return _label(d, n, where)

        for t in out:
            deps = {label(b, t.directory) for a in t.attrs.pop("_nodes") for b in graph[a]}
            deps.discard(f":{t.name}")
            t.attrs["deps"] = _sorted_labels(deps)

        out += self.binary_targets(label)
        out += self.test_targets(label)
        return out

    def binary_targets(self, label) -> list[Target]:
        out = []
        for file in sorted(self.entry_points.values()):
            node = self.node_of_file(file)
            where = self.src.packages[node.package]
            deps = {label(node, where)} if node in self._library_nodes() else set()
            for ref in self.src.refs(file):
                self.src.check_exists(ref)
                deps.add(label(self.node_of_name(ref.name), where))
            out.append(Target("py_binary", where, Path(file).stem, {
                "srcs": [Path(file).name], "main": Path(file).name,
                "deps": _sorted_labels(deps),
            }))
        return out

    def _library_nodes(self) -> set[Node]:
        return {self.node_of_file(f) for n, f in self.src.modules.items()
                if n not in self.entry_points}

    def test_targets(self, label) -> list[Target]:
        root = self.root / TESTS
        helpers: dict[str, str] = {}  # module name -> file, for helpers imported via sys.path
        files_by_dir: dict[str, list[str]] = {}
        for directory, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith((".", "__")))
            rel = Path(directory).relative_to(self.root).as_posix()
            py = sorted(f for f in files if f.endswith(".py"))
            if py:
                files_by_dir[rel] = py
            for f in py:
                if not f.startswith("test_") and f not in ("conftest.py", RUNNER):
                    stem = f[:-3]
                    if stem in helpers:
                        raise BuildError(f"two test helpers named {stem}: {helpers[stem]} and "
                                         f"{rel}/{f}; rename one")
                    helpers[stem] = f"{rel}/{f}"

        def conftest_label(directory: str, where: str) -> str | None:
            while True:
                if "conftest.py" in files_by_dir.get(directory, []):
                    return _label(directory, "conftest", where)
                if directory == TESTS:
                    return None
                directory = directory.rsplit("/", 1)[0]

        def deps_and_data(file: str, where: str) -> tuple[list[str], list[str]]:
            deps, data = set(), set()
            for ref in self.src.refs(file, local=helpers):
                top = ref.name.split(".")[0]
                if top in helpers:
                    helper = helpers[top]
                    if helper != file:
                        deps.add(_label(helper.rsplit("/", 1)[0], top, where))
                    continue
                self.src.check_exists(ref)
                if ref.name in self.entry_points:
                    data.add(_label(BINARY_ROOT, ref.name.rsplit(".", 1)[1], where))
                else:
                    deps.add(label(self.node_of_name(ref.name), where))
            return _sorted_labels(deps), _sorted_labels(data)

        out = []
        for rel, files in sorted(files_by_dir.items()):
            parent = rel.rsplit("/", 1)[0] if rel != TESTS else None
            for f in files:
                file = f"{rel}/{f}"
                deps, data = deps_and_data(file, rel)
                if f == RUNNER:
                    out.append(Target("exports_files", rel, "", {"files": [f]}))
                elif f == "conftest.py":
                    up = conftest_label(parent, rel) if parent else None
                    deps = _sorted_labels(set(deps) | ({up} if up else set()))
                    out.append(Target("py_library", rel, "conftest",
                                      {"srcs": [f], "deps": deps, "testonly": True}))
                elif f.startswith("test_"):
                    conftest = conftest_label(rel, rel)
                    deps = _sorted_labels(set(deps) | ({conftest} if conftest else set()))
                    attrs = {"src": f, "data": data, "deps": deps, "size": "medium"}
                    attrs |= TEST_OPTIONS.get(file, {})
                    if file in CI_TESTS:
                        attrs["tags"] = sorted(set(attrs.get("tags", [])) | {"ci"})
                    out.append(Target("pytest_test", rel, f[:-3], attrs))
                else:
                    # A helper that runs an entry point (support.train_cmd) carries it as data,
                    # into the runfiles of every test that uses the helper.
                    out.append(Target("py_library", rel, f[:-3],
                                      {"srcs": [f], "data": data, "deps": deps,
                                       "testonly": True}))
        unknown = set(TEST_OPTIONS) - {f"{r}/{f}" for r, fs in files_by_dir.items() for f in fs}
        if unknown:
            raise BuildError(f"TEST_OPTIONS in scripts/bazel_build.py names missing test modules "
                             f"{sorted(unknown)}; update it")
        modules = {f"{r}/{f}" for r, fs in files_by_dir.items() for f in fs
                   if f.startswith("test_")}
        if CI_TESTS - modules:
            raise BuildError(f"CI_TESTS in scripts/bazel_build.py names missing test modules "
                             f"{sorted(CI_TESTS - modules)}; update it")
        uncovered = sorted(r for r in files_by_dir
                           if any(f.startswith("test_") for f in files_by_dir[r])
                           and r not in CI_EXEMPT
                           and not any(m.rsplit("/", 1)[0] == r for m in CI_TESTS))
        if uncovered:
            raise BuildError(f"{', '.join(uncovered)}: no test module of it is in CI_TESTS in "
                             "scripts/bazel_build.py; add a cheap one (CI runs those under "
                             "Bazel), or the package to CI_EXEMPT with the reason")
        return out


def _label(directory: str, name: str, where: str) -> str:
    if directory == where:
        return f":{name}"
    return f"//{directory}" if directory.rsplit("/", 1)[-1] == name else f"//{directory}:{name}"


def _sorted_labels(labels: Iterable[str]) -> list[str]:
    # Local labels first, then the others, as buildifier orders them.
    return sorted(labels, key=lambda s: (not s.startswith(":"), s))


def _value(v, indent: str) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, Glob):
        inc = _value(v.include, indent)
        return f"glob({inc}, exclude = {_value(v.exclude, indent)})" if v.exclude \
            else f"glob({inc})"
    if len(v) <= 1:
        return "[" + ", ".join(_value(x, indent) for x in v) + "]"
    inner = indent + "    "
    return "[\n" + "".join(f"{inner}{_value(x, inner)},\n" for x in v) + indent + "]"


def _render(t: Target) -> str:
    if t.rule == "exports_files":
        return f"exports_files({_value(t.attrs['files'], '')})\n"
    lines = [f"{t.rule}(\n", f'    name = "{t.name}",\n']
    for key in ("srcs", "src", "main", "data", "deps", "size", "shard_count", "tags", "testonly"):
        value = t.attrs.get(key)
        if value is None or (isinstance(value, list) and not value):
            continue
        lines.append(f"    {key} = {_value(value, '    ')},\n")
    lines.append(")\n")
    return "".join(lines)


def generate(root: Path) -> dict[str, str]:
    """The content of every generated BUILD file, keyed by its path relative to `root`."""
    by_dir: dict[str, list[Target]] = {}
    for t in Generator(root).targets():
        by_dir.setdefault(t.directory, []).append(t)
    out = {}
    for directory, targets in sorted(by_dir.items()):
        rank = {"exports_files": 0, "py_library": 1, "py_binary": 2, "pytest_test": 3}
        targets.sort(key=lambda t: (rank[t.rule], t.name))
        head = HEADER
        if any(t.rule == "pytest_test" for t in targets):
            head += '\nload("//tests:pytest.bzl", "pytest_test")\n'
        head += '\npackage(default_visibility = ["//visibility:public"])\n'
        out[f"{directory}/BUILD"] = head + "".join("\n" + _render(t) for t in targets)
    return out


def existing(root: Path) -> set[str]:
    """The BUILD files under the generated trees, as they are on disk."""
    found = set()
    for top in (*LIBRARY_ROOTS, BINARY_ROOT, TESTS):
        for path in (root / top).rglob("BUILD"):
            found.add(path.relative_to(root).as_posix())
    return found


def stale(root: Path) -> list[str]:
    """BUILD files that differ from the generated ones, or should not exist; [] if none."""
    want = generate(root)
    have = existing(root)
    out = [p for p in sorted(want) if p not in have or (root / p).read_text() != want[p]]
    return out + sorted(have - set(want))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a BUILD file is out of date")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    try:
        want = generate(root)
        bad = stale(root)
    except BuildError as e:
        print(f"bazel_build: {e}", file=sys.stderr)
        return 1
    if args.check:
        for p in bad:
            print(f"stale: {p}", file=sys.stderr)
        if bad:
            print("run `python scripts/bazel_build.py` to rewrite them", file=sys.stderr)
        return 1 if bad else 0
    for p in bad:
        if p in want:
            (root / p).write_text(want[p])
            print(f"wrote {p}")
        else:
            (root / p).unlink()
            print(f"removed {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
