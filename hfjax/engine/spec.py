"""The rollout's settings as one typed, frozen value.

A run's `rollout` config section is read once, into a `RolloutSpec` (`RolloutSpec.of`), where
the worker groups are built; the engine and the actor read its fields, never the config's keys.
Defaults are written here only: a key a config leaves out (tests, benchmarks and user code
build partial sections) takes the value below. The config checks (`hfjax.config`) have
refused bad values before this runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Continuous batching (`hfjax.engine.continuous`).
DEFAULT_SLOTS = 0  # one per request
DEFAULT_REFILL_EVERY = 8
DEFAULT_MIN_SLOTS = 0  # the start of the row range the slots are in (continuous.ROW_RANGES)


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """How the actor generates (the config's `rollout` section; docs/architecture.md).

    `decode_mesh` is the hybrid engine's decode mesh: "" when `rollout.hybrid_engine` is off
    or `rollout.mesh` is empty, so the one question "does the actor reshard for decoding?" is
    answered here and nowhere else.
    """

    n: int = 1
    response_length: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    decode_mesh: str = ""
    offload_optimizer: bool = False
    mode: str = "static"
    decode_attention: str = "auto"
    kv_layout: str = "auto"
    slots: int = DEFAULT_SLOTS
    refill_every: int = DEFAULT_REFILL_EVERY
    min_slots: int = DEFAULT_MIN_SLOTS
    max_cache_len: int = 0  # 0: no limit

    @classmethod
    def of(cls, rollout: Any) -> RolloutSpec:
        """`rollout` itself when it is a RolloutSpec, else the spec of a config section (a
        ConfigDict or a mapping)."""
        if isinstance(rollout, cls):
            return rollout
        get = rollout.get
        hybrid = bool(get("hybrid_engine", True))
        values = {f.name: get(f.name, f.default) for f in dataclasses.fields(cls)
                  if f.name != "decode_mesh"}
        return cls(**values, decode_mesh=str(get("mesh", "") or "") if hybrid else "")
