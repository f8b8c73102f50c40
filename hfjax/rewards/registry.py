"""Rule rewards keyed by `data_source`.

A reward function has the signature `fn(data_source, solution_str, ground_truth, extra_info)`
and returns a float (or a dict with a "score" key and extra diagnostics).
"""

from __future__ import annotations

from collections.abc import Callable

RewardFn = Callable[[str, str, str, dict | None], float | dict]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(*data_sources: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a rule reward for one or more data sources."""

    def deco(fn: RewardFn) -> RewardFn:
        for ds in data_sources:
            if ds in _REWARDS and _REWARDS[ds] is not fn:
                raise ValueError(f"a reward for data_source {ds!r} is already registered")
            _REWARDS[ds] = fn
        return fn

    return deco


def get_reward_fn(data_source: str) -> RewardFn:
    """The reward for `data_source`; ValueError naming the known sources otherwise."""
    _load_builtin()
    if data_source not in _REWARDS:
        raise ValueError(
            f"no reward function for data_source {data_source!r}; known: "
            f"{', '.join(sorted(_REWARDS))}. Register one with @register_reward or set "
            "reward.custom_fn"
        )
    return _REWARDS[data_source]


def _load_builtin() -> None:
    from hfjax.rewards import math  # noqa: F401  (registers on import)
