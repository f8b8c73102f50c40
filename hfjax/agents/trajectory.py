"""A multi-turn rollout's result: one `Trajectory` per row (its turns, for rewards, metrics
and inspection) and the `AgentOutput` host arrays the actor trains on."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class Trajectory:
    """One row's turns, for rewards, metrics and inspection (JSON-able via `to_dict`).

    `turns`: {"role": "assistant", "text", "tokens"} for policy turns and {"role": "tool",
    "calls": [{"name", "arguments"} or None for a malformed one], "results": [{"text",
    "error"}], "tokens"} for tool turns; `stop`: "eos" (a turn without calls ended
    at EOS), "max_turns", "length" (the budget spent) or "tool_length" (a tool turn did not fit
    what was left of the budget and was dropped)."""

    turns: list[dict] = dataclasses.field(default_factory=list)
    stop: str = ""

    @property
    def num_turns(self) -> int:
        return sum(t["role"] == "assistant" for t in self.turns)

    @property
    def tool_calls(self) -> int:
        return sum(len(t["calls"]) for t in self.turns if t["role"] == "tool")

    @property
    def tool_errors(self) -> int:
        return sum(r["error"] for t in self.turns if t["role"] == "tool" for r in t["results"])

    def to_dict(self) -> dict:
        return {"turns": self.turns, "stop": self.stop, "num_turns": self.num_turns,
                "tool_calls": self.tool_calls, "tool_errors": self.tool_errors}


@dataclasses.dataclass
class AgentOutput:
    """Host arrays [rows, max_new_tokens] (row b * n + j is sample j of prompt b): `tokens`
    (pad after the end), `gen_mask` (1 on tokens the policy generated), `attn_mask` (1 on every
    real response token, observations included), `logprobs` (the sampler's, 0 off gen_mask);
    and one `Trajectory` per row."""

    tokens: np.ndarray
    gen_mask: np.ndarray
    attn_mask: np.ndarray
    logprobs: np.ndarray
    trajectories: list[Trajectory]


def trajectory_json(traj: Trajectory) -> str:
    """A trajectory as one JSON line's text."""
    return json.dumps(traj.to_dict(), ensure_ascii=False)


def turn_lists(trajs: Sequence[Trajectory]) -> dict[str, np.ndarray]:
    """Per-row counts [rows] int32: num_turns, tool_calls, tool_errors."""
    return {k: np.array([getattr(t, k) for t in trajs], np.int32)
            for k in ("num_turns", "tool_calls", "tool_errors")}
