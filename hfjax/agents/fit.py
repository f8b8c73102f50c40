"""Checks that a multi-turn rollout's settings fit the engine it runs on, made when the run is
built, before anything compiles."""

from __future__ import annotations

import numpy as np


def check_agent_fits(sampler, max_prompt_length: int, response_length: int) -> None:
    """Refuses a sampler that cannot hold a trajectory: the first turn prefills the prompt, so
    the sampler's prompt limit must hold `max_prompt_length`; every row keeps its cache for the
    whole trajectory (`hfjax.engine.session`), prompt and response budget together, so a
    continuous engine's `max_cache_len`, the bound a run sets on a row's cache, must hold both.
    Called where the run builds its loop, so a run that would fail is refused before its first
    program compiles."""
    if sampler.max_prompt_len < max_prompt_length:
        raise ValueError(f"multi-turn rollouts prefill prompts of up to {max_prompt_length} "
                         f"tokens (data.max_prompt_length), more than the sampler's "
                         f"max_prompt_len={sampler.max_prompt_len}; build it with "
                         f"max_prompt_len >= {max_prompt_length}")
    need = max_prompt_length + response_length
    cap = getattr(sampler, "max_cache_len", None)
    if cap is not None and cap < need:
        raise ValueError(f"rollout.max_cache_len={cap} cannot hold a multi-turn row's cache of "
                         f"{need} tokens (data.max_prompt_length + rollout.response_length); "
                         f"set --config.rollout.max_cache_len to 0 or >= {need}")


def check_spec(spec) -> None:
    """Refuses settings of `rollout.multi_turn` (a `MultiTurnSpec`) no trajectory can run with,
    in one line naming the key and its fix. The config's key table checks the same ranges;
    this holds for a spec built directly."""
    for name in ("max_turns", "max_tool_response_len", "tool_workers",
                 "max_parallel_calls"):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"rollout.multi_turn.{name}={v!r}; it must be an int >= 1 (set "
                             f"--config.rollout.multi_turn.{name})")
