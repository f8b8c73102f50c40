"""Smoke mode: `HFJAX_SMOKE=1` shrinks any command to the least work that still runs its code path.

Every entry point applies it through `launch.cli.run` (and so does every script in scripts/, whose
stages are these entry points; `scripts/install.sh` checks the installed packages instead of
installing): training steps to 2 (SFT, reward-model and RL steps, validation and a checkpoint at
the last step), 16 held-out prompts, 16-token responses, a checkpoint's first 2 decoder layers
(`model.max_layers`, generate's `--max_layers`), 64 + 16 generated prompts or pairs, 8
new tokens, 16 evaluated prompts, no alternative plans and a minute of compiling for
`launch.plan`. Only sizes go down; every other setting, the files read and
written and the printed summaries are those of the full command. CI runs every command that
README.md and docs/ show this way (tests/test_documented_commands.py).

The overrides are this module's two tables, one for config keys and one for entry points' flags;
nothing else in the project looks at the variable.
"""

from __future__ import annotations

import os
import sys

ENV = "HFJAX_SMOKE"

# Config key -> the most it may be in smoke mode (a key a config does not have is skipped; a value
# already smaller, or 0 where 0 means "off", stays).
CONFIG_LIMITS: dict[str, int] = {
    "trainer.total_steps": 2,
    "trainer.test_freq": 2,
    "trainer.save_freq": 2,
    "trainer.log_every": 1,
    "sft.steps": 2,
    "rm.steps": 2,
    "rm.eval_every": 1,
    "dpo.steps": 2,
    "dpo.eval_every": 1,
    "data.n_test": 16,
    "rollout.response_length": 16,
    # A checkpoint's first 2 decoder layers (SmolLM2 has 30; presets keep their depth).
    "model.max_layers": 2,
}
# Keys of CONFIG_LIMITS whose 0 means "all", not "off": smoke mode lowers 0 to the limit too.
ZERO_IS_ALL = {"model.max_layers"}

# Entry point -> {flag: the most it may be}.
FLAG_LIMITS: dict[str, dict[str, int]] = {
    "prepare_data": {"n_train": 64, "n_test": 16},
    "generate": {"max_new_tokens": 8, "max_layers": 2},
    "evaluate": {"limit": 16},
    # With --prices=compiled, only the best plan's programs are compiled, for a minute at most.
    "plan": {"alternatives": 0, "compile_budget_s": 60},
}
# Flags of FLAG_LIMITS whose 0 means "all" (evaluate's --limit, generate's --max_layers).
ZERO_IS_ALL_FLAGS = {"limit", "max_layers"}


def enabled() -> bool:
    """Whether HFJAX_SMOKE asks for smoke mode (set, and not empty or 0)."""
    return os.environ.get(ENV, "") not in ("", "0")


def shrink_config(cfg) -> list[str]:
    """Lowers `cfg`'s keys in CONFIG_LIMITS in place; returns the changes as 'key a->b'."""
    changes = []
    for key, limit in CONFIG_LIMITS.items():
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = node.get(part) if hasattr(node, "get") else None
            if node is None:
                break
        if node is None or leaf not in node:
            continue
        value = node[leaf]
        if isinstance(value, int) and (value > limit or value == 0 and key in ZERO_IS_ALL):
            node[leaf] = limit
            changes.append(f"{key} {value}->{limit}")
    return changes


def shrink_flags(entry: str, flag_values) -> list[str]:
    """Lowers entry point `entry`'s flags in FLAG_LIMITS (an absl FlagValues) in place; a flag
    at 0 that means "all" (ZERO_IS_ALL_FLAGS) gets the limit. Returns the changes."""
    changes = []
    for name, limit in FLAG_LIMITS.get(entry, {}).items():
        if name not in flag_values:
            continue
        value = flag_values[name].value
        if value is None or value > limit or (name in ZERO_IS_ALL_FLAGS and value == 0):
            flag_values[name].value = limit
            changes.append(f"--{name} {value}->{limit}")
    return changes


def apply(entry: str, flag_values) -> None:
    """In smoke mode, shrinks entry point `entry`'s flags and its `--config` (when it has one)
    and says what changed on stderr, one line."""
    if not enabled():
        return
    changes = shrink_flags(entry, flag_values)
    if "config" in flag_values and flag_values["config"].value is not None:
        changes += shrink_config(flag_values["config"].value)
    print(f"hfjax {entry}: {ENV}=1 (smoke mode): {', '.join(changes) or 'nothing to shrink'}",
          file=sys.stderr, flush=True)
