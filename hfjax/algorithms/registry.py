"""Algorithms by name: each is a short dataflow over worker groups (one training step).

A driver has the signature `step(w: WorkerGroups, batch: Batch, spec: StepSpec) -> (batch,
metrics)`: it takes a host batch of prompts and its settings (`hfjax.algorithms.spec`, read once
from the config) and returns the batch it built (responses, scores, advantages, ...) and the
step's metrics (device scalars). It is registered with the roles it needs, so the trainer
builds only those worker groups, and optionally with a `check(cfg)` that refuses config
settings the algorithm cannot run with, before anything is built.

`--config.algorithm` names a registered algorithm, or a user's own as `package.module:step`
(or `path/to/file.py:step`): the module is imported, which registers its driver (and any role,
estimator or model it brings), and the registered algorithm whose step that function is, is
used. Nothing inside hfjax needs editing (docs/algorithms.md walks through one).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from hfjax.numerics.core import Registry
from hfjax.rewards.custom import import_file


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered driver: its step, the roles it needs, the batch arrays it produces for the
    advantage stage beyond rewards and masks (e.g. "values" from a critic), and a config check
    that raises ValueError for settings it cannot run with."""

    name: str
    step: Callable
    roles: tuple[str, ...]
    provides: tuple[str, ...] = ()
    check: Callable[[Any], None] | None = None


ALGORITHMS: Registry = Registry("algorithm")

# The modules whose import registers the built-in drivers.
BUILTIN_MODULES = ("ppo", "grpo", "reinforce", "remax", "dapo", "safe_rlhf")


def register_algorithm(name: str, roles: tuple[str, ...], provides: tuple[str, ...] = (),
                       check: Callable[[Any], None] | None = None):
    """Decorator registering a driver step under `name`, needing worker groups `roles`,
    producing the batch arrays `provides` for the advantage estimators, and refusing configs
    that `check(cfg)` raises ValueError on. One step may be registered under several names
    (variants that differ only in their settings and checks). A role alias in `roles`
    ("rollout": the actor generates) is dropped, as placements drop it."""
    from hfjax.controller.placement import ROLE_ALIASES

    roles = tuple(r for r in roles if r not in ROLE_ALIASES)

    def deco(fn):
        ALGORITHMS.register(name)(Algorithm(name, fn, roles, tuple(provides), check))
        return fn

    return deco


def requires(algorithm: str, **settings: Any) -> Callable[[Any], None]:
    """A config check that the dotted settings (`actor__policy_loss="gspo"` for
    actor.policy_loss) have the given values, naming each one that differs and its fix."""

    def check(cfg) -> None:
        for key, want in settings.items():
            path = key.replace("__", ".")
            have = cfg
            for part in path.split("."):
                have = have[part]
            if have != want:
                raise ValueError(
                    f"algorithm {algorithm!r} runs with {path}={want!r}, the config has "
                    f"{have!r}; set --config.{path}={want} (configs/{algorithm}_arith.py does)")

    return check


def all_of(*checks: Callable[[Any], None]) -> Callable[[Any], None]:
    """A config check running each of `checks` in turn."""

    def check(cfg) -> None:
        for c in checks:
            c(cfg)

    return check


def _load_builtin() -> None:
    for mod in BUILTIN_MODULES:
        importlib.import_module(f"hfjax.algorithms.{mod}")


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm `name`, or the user algorithm `module:step` (see the module
    docstring); ValueError naming the problem and the fix otherwise."""
    _load_builtin()
    if name in ALGORITHMS:
        return ALGORITHMS.get(name)
    if ":" not in name:
        raise ValueError(
            f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS.names())}, or a user "
            "algorithm as --config.algorithm=package.module:step (or path/to/file.py:step)")
    return _user_algorithm(name)


def _user_algorithm(spec: str) -> Algorithm:
    try:
        fn = import_spec(spec)
    except ValueError as err:
        raise ValueError(f"algorithm {err}") from None
    for known in ALGORITHMS.names():
        algo = ALGORITHMS.get(known)
        if algo.step is fn:
            return algo
    raise ValueError(
        f"algorithm {spec!r}: {spec.rpartition(':')[2]} is not a registered driver; decorate "
        "it with @hfjax.algorithms.registry.register_algorithm(name, roles=(...))")


def import_spec(spec: str):
    """The object named by `package.module:name` or `path/to/file.py:name` (the module is
    imported); ValueError naming the problem otherwise."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(f"{spec!r}: write package.module:name or path/to/file.py:name")
    module = _import(where, spec)
    if not hasattr(module, attr):
        raise ValueError(f"{spec!r}: module {module.__name__} has no attribute {attr!r}")
    return getattr(module, attr)


def _import(where: str, spec: str):
    if where.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(where))
        if not os.path.isfile(path):
            raise ValueError(f"{spec!r}: file {path} does not exist")
        return import_file(path, "hfjax_user_algorithm_", repr(spec))
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        if not err.name or not (where == err.name or where.startswith(err.name + ".")):
            raise  # the module exists but one of its own imports is missing: show that
        raise ValueError(
            f"{spec!r}: cannot import module {where!r} ({err}); put its package on "
            "PYTHONPATH (or run from its parent directory), or give a file: "
            "path/to/file.py:step") from None
