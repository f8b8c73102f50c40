"""Algorithms by name: each is a short dataflow over worker groups (one training step).

A driver has the signature `step(w: Workers, batch: Batch, cfg) -> dict of metrics` and is
registered with the roles it needs, so the trainer builds only those worker groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hfjax.algorithms.core import Registry


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    step: Callable
    roles: tuple[str, ...]


ALGORITHMS: Registry = Registry("algorithm")


def register_algorithm(name: str, roles: tuple[str, ...]):
    """Decorator registering a driver step under `name`, needing worker groups `roles`."""

    def deco(fn):
        ALGORITHMS.register(name)(Algorithm(name, fn, tuple(roles)))
        return fn

    return deco


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm; ValueError listing the known ones otherwise."""
    from hfjax.algorithms import grpo, ppo  # noqa: F401  (registration on import)

    return ALGORITHMS.get(name)
