"""A user's reward function, loaded from a `path/to/file.py:fn` spec.

The function has verl's signature `fn(data_source, solution_str, ground_truth, extra_info)` and
returns a float or a dict with a "score" key. As in verl, a custom function replaces the
built-in rewards for every data source.

The controller never imports the file: `CustomReward` stands for it, checked by `check_spec`
(the spec's form, the file exists) and carrying its spec (`__hfjax_spec__`), so that the reward
scorer processes import the file themselves, under the reward timeout (`hfjax.rewards.pool`).
A file that hangs or fails while importing therefore cannot hang or crash the controller. Only
`reward.num_processes=0` (scoring in the controller) imports it here, on the first call.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

# verl's reward signature fn(data_source, solution_str, ground_truth, extra_info) -> float | dict
# (`hfjax.rewards.registry.RewardFn`; the registry imports this module, not the other way).
RewardFn = Callable[[str, str, str, dict | None], float | dict]

SPEC_ATTR = "__hfjax_spec__"


def parse_spec(spec: str) -> tuple[Path, str]:
    """(absolute file path, function name) from `path/to/file.py:fn`; ValueError if malformed."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise ValueError(
            f"reward.custom_fn {spec!r} must look like path/to/file.py:function_name"
        )
    return Path(os.path.expanduser(path)).resolve(), name


def check_spec(spec: str) -> tuple[Path, str]:
    """(file, function name) of `spec`, checked without importing the file: the spec's form,
    and that the file exists; ValueError naming the problem otherwise."""
    path, name = parse_spec(spec)
    if not path.is_file():
        raise ValueError(f"reward.custom_fn {spec!r}: file {path} does not exist")
    return path, name


class CustomReward:
    """A custom reward function named by its spec; the file is imported on the first call in
    this process (scorer processes load it by the spec instead, see the module docstring)."""

    def __init__(self, spec: str):
        path, name = check_spec(spec)
        self.spec = f"{path}:{name}"
        setattr(self, SPEC_ATTR, self.spec)
        self.__name__ = self.__qualname__ = name

    def __call__(self, data_source, solution_str, ground_truth, extra_info):
        return load_custom_reward(self.spec)(data_source, solution_str, ground_truth, extra_info)

    def __eq__(self, other) -> bool:
        return isinstance(other, CustomReward) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"CustomReward({self.spec!r})"


def import_file(path: str, prefix: str, setting: str) -> ModuleType:
    """The module of the Python file at the absolute `path`, imported once per process (a
    custom reward's file; user algorithms' and tools' files too, `hfjax.algorithms.registry`,
    `hfjax.tools.registry`).

    Its name is `prefix` plus the path with every other character an underscore, so two files
    with the same base name are two modules, and importing a file again returns the first
    module. What the file raises while importing propagates (and leaves no half-made module
    behind); ValueError naming `setting` when the path cannot be imported as a module at all.
    """
    name = prefix + "".join(c if c.isalnum() else "_" for c in str(path))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{setting}: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _load_module(path: Path):
    return import_file(str(path), "hfjax_custom_reward_", "reward.custom_fn")


def load_custom_reward(spec: str) -> RewardFn:
    """The function named by `spec`, importing its file in this process; ValueError naming the
    missing file or function, or what importing it raised."""
    path, name = check_spec(spec)
    try:
        module = _load_module(path)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(
            f"reward.custom_fn {spec!r}: importing {path} raised {type(err).__name__}: {err}"
        ) from err
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(
            n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
        )
        raise ValueError(
            f"reward.custom_fn {spec!r}: {path} has no function {name!r}; "
            f"it defines: {', '.join(public) or 'nothing callable'}"
        )
    if not callable(fn):
        raise ValueError(f"reward.custom_fn {spec!r}: {name} is a {type(fn).__name__}, "
                         "not a function")
    _check_signature(spec, fn)
    try:
        setattr(fn, SPEC_ATTR, f"{path}:{name}")
    except (AttributeError, TypeError):
        pass  # a builtin or a callable object that refuses attributes: scorers load by spec
    return fn


def _check_signature(spec: str, fn) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind("data_source", "solution", "ground_truth", {})
    except TypeError as err:
        raise ValueError(
            f"reward.custom_fn {spec!r}: {fn.__name__}{sig} cannot be called as "
            "fn(data_source, solution_str, ground_truth, extra_info)"
        ) from err
