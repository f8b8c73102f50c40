"""Rule rewards keyed by `data_source`, with a ground-truth check for each.

A reward function has verl's signature `fn(data_source, solution_str, ground_truth, extra_info)`
and returns a float, or a dict whose "score" key holds the float (other keys are diagnostics).

Each registered reward may come with a *check*, `check(ground_truth, extra_info) -> str | None`,
that says why a ground truth cannot be scored (None when it can). The dataset runs it on every
row before training, so a ground truth the reward would never match becomes a counted skip
instead of a silent zero.

Lookup order for a row (`get_reward_fn`):
1. a custom function (`reward.custom_fn=path.py:fn`), which, as in verl, replaces every
   built-in reward;
2. a reward registered for the row's `reward_model.style` (e.g. "math_verify"), so a dataset
   can pick its scorer without a new data_source;
3. a reward registered for the exact `data_source`;
4. a reward registered for a prefix of it (e.g. every "reasoning_gym/<task>").

Registration points one way: the built-in rewards (`hfjax.rewards.math`,
`hfjax.rewards.reasoning_gym`) import this module and register themselves, and the package's
`__init__` imports them, so they are registered before anything here is called; this module
imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hfjax.rewards.custom import CustomReward, RewardFn

CheckFn = Callable[[str, dict | None], str | None]


@dataclass(frozen=True)
class Reward:
    """A rule reward and the check its ground truths must pass (None: anything goes)."""

    fn: RewardFn
    check: CheckFn | None = None


# A prefix resolver maps a full data_source to its Reward, raising ValueError when the part after
# the prefix names nothing it knows (e.g. a reasoning-gym task that does not exist).
PrefixResolver = Callable[[str], Reward]

_SOURCES: dict[str, Reward] = {}
_STYLES: dict[str, Reward] = {}
_PREFIXES: dict[str, PrefixResolver] = {}

# Styles that say "score by data_source" rather than naming a scorer.
_GENERIC_STYLES = ("", "rule")


def register_reward(
    *data_sources: str, styles: tuple[str, ...] = (), check: CheckFn | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a rule reward for data sources and/or reward_model styles."""

    def deco(fn: RewardFn) -> RewardFn:
        entry = Reward(fn, check)
        for table, keys, kind in ((_SOURCES, data_sources, "data_source"),
                                  (_STYLES, styles, "reward_model.style")):
            for key in keys:
                if key in table and table[key].fn is not fn:
                    raise ValueError(f"a reward for {kind} {key!r} is already registered")
                table[key] = entry
        return fn

    return deco


def register_prefix(prefix: str, resolver: PrefixResolver) -> None:
    """Route every data_source starting with `prefix` to `resolver(data_source)`."""
    if prefix in _PREFIXES and _PREFIXES[prefix] is not resolver:
        raise ValueError(f"a reward resolver for prefix {prefix!r} is already registered")
    _PREFIXES[prefix] = resolver


def known_sources() -> list[str]:
    """Registered data sources, styles and prefixes, for error messages."""
    return (
        sorted(_SOURCES)
        + [f"style={s}" for s in sorted(_STYLES)]
        + [f"{p}<name>" for p in sorted(_PREFIXES)]
    )


def resolve_reward(
    data_source: str, style: str | None = None, custom_fn: str | None = None
) -> Reward:
    """The Reward for a row (see the module docstring for the order); ValueError naming the
    known sources when nothing matches."""
    if custom_fn:
        return Reward(CustomReward(custom_fn))
    if style and style not in _GENERIC_STYLES and style in _STYLES:
        return _STYLES[style]
    if data_source in _SOURCES:
        return _SOURCES[data_source]
    for prefix, resolver in _PREFIXES.items():
        if data_source.startswith(prefix):
            return resolver(data_source)
    raise ValueError(
        f"no reward function for data_source {data_source!r}"
        + (f" (reward_model.style {style!r})" if style and style not in _GENERIC_STYLES else "")
        + f"; known: {', '.join(known_sources())}. Register one with @register_reward, or set "
        "reward.custom_fn=path/to/file.py:fn"
    )


def get_reward_fn(
    data_source: str, style: str | None = None, custom_fn: str | None = None
) -> RewardFn:
    """The reward function for a row; ValueError naming the known sources when none matches."""
    return resolve_reward(data_source, style, custom_fn).fn


def check_ground_truth(
    data_source: str,
    ground_truth: str,
    extra_info: dict | None = None,
    style: str | None = None,
    custom_fn: str | None = None,
) -> str | None:
    """Why the row's reward cannot score `ground_truth`, or None when it can.

    Unknown data sources raise ValueError (a configuration error, not a bad row). A custom
    function is opaque, so its ground truths pass unchecked.
    """
    reward = resolve_reward(data_source, style, custom_fn)
    if reward.check is None:
        return None
    try:
        return reward.check(ground_truth, extra_info)
    except Exception as err:  # a check that crashes has still found a row it cannot score
        return f"ground truth check raised {type(err).__name__}: {err}"

