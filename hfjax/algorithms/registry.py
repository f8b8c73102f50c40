"""Algorithms by name: each is a short dataflow over worker groups (one training step).

A driver has the signature `step(w: WorkerGroups, batch: Batch, cfg) -> (batch, metrics)`: it
takes a host batch of prompts and returns the batch it built (responses, scores, advantages,
...) and the step's metrics (device scalars). It is registered with the roles it needs, so the
trainer builds only those worker groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hfjax.numerics.core import Registry


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered driver: its step, the roles it needs, and the batch arrays it produces
    for the advantage stage beyond rewards and masks (e.g. "values" from a critic)."""

    name: str
    step: Callable
    roles: tuple[str, ...]
    provides: tuple[str, ...] = ()


ALGORITHMS: Registry = Registry("algorithm")


def register_algorithm(name: str, roles: tuple[str, ...], provides: tuple[str, ...] = ()):
    """Decorator registering a driver step under `name`, needing worker groups `roles` and
    producing the batch arrays `provides` for the advantage estimators."""

    def deco(fn):
        ALGORITHMS.register(name)(Algorithm(name, fn, tuple(roles), tuple(provides)))
        return fn

    return deco


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm; ValueError listing the known ones otherwise."""
    from hfjax.algorithms import grpo, ppo  # noqa: F401  (registration on import)

    return ALGORITHMS.get(name)
