"""Typed, frozen settings read once from a config section, and the rollout's (`RolloutSpec`).

A run's config is checked by `hfjax.config` (every key of the key table, with a valid value)
and then read once into specs: the rollout's here, the roles' in `hfjax.workers.spec`, both
through `Spec.of`. Code below that reads a spec's fields, never a config's keys.

A spec has no defaults of its own: the defaults are the config's (configs/ppo_arith.py, from
which every config derives, and whose every key `hfjax.config.check_config` asks for), so a
section without one of the spec's keys is refused here, by name. Values are checked for their
type here too (a string where an int belongs fails now, not inside a jitted step); their
ranges and names are each field's check, declared with the field (`hfjax.settings.key`) and
run before this as the key table's rows (`hfjax.config.keys` gathers them).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

from hfjax.settings import Bool, Check, Choice, Float, Int, checks, key

S = TypeVar("S")

_TYPES = {int: "an int", float: "a float", bool: "True or False", str: "a string"}


def typed_value(section: str, name: str, v: Any, kind: type) -> Any:
    """`v` as `kind`, or a ValueError naming the key `section.name` and the fix. An int is
    not a bool (nor a bool an int); an int is a float."""
    if kind is bool:
        ok = isinstance(v, bool)
    elif kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    else:
        ok = isinstance(v, kind)
    if not ok:
        raise ValueError(f"{section}.{name}={v!r} needs {_TYPES[kind]}; set "
                         f"--config.{section}.{name} to one")
    return kind(v)


def read_spec(cls: type[S], section: Any, name: str) -> S:
    """The spec `cls` read from the config section `name` (a ConfigDict or a mapping): every
    field is the key of its name, which the section must have, with a value of the field's
    type; a field whose type is itself a spec is read from the subsection of its name
    (`rollout.multi_turn`). `section` itself when it is already a `cls`."""
    if isinstance(section, cls):
        return section
    if section is None:
        raise ValueError(f"the config has no {name} section; derive the config from "
                         "configs/ppo_arith.py")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in section:
            raise ValueError(f"the config's {name} section has no key {f.name}; derive the "
                             f"config from configs/ppo_arith.py, or set --config.{name}."
                             f"{f.name}")
        kind, value = hints[f.name], section[f.name]
        values[f.name] = (read_spec(kind, value, f"{name}.{f.name}")
                          if dataclasses.is_dataclass(kind)
                          else typed_value(name, f.name, value, kind))
    return cls(**values)


class Spec:
    """`of`: a spec read from its config section (`ROLE` unless another is named);
    `require`: the check at a constructor that takes a built spec, not a config section."""

    ROLE: typing.ClassVar[str]

    @classmethod
    def of(cls: type[S], section: Any, role: str | None = None) -> S:
        """`section` itself when it is already this spec, else the spec of a config section."""
        return read_spec(cls, section, role or cls.ROLE)

    @classmethod
    def require(cls, value: Any, owner: str, name: str) -> None:
        """TypeError unless `value` (`owner`'s keyword `name`) is a `cls`, naming the fix."""
        if not isinstance(value, cls):
            raise TypeError(f"{owner}: {name}= is a {type(value).__name__}, not the "
                            f"{cls.__name__} it needs; build it once with "
                            f"{cls.__name__}.of(cfg.{cls.ROLE})")


@dataclasses.dataclass(frozen=True)
class MultiTurnSpec(Spec):
    """Multi-turn rollouts with tools (`rollout.multi_turn`, `hfjax.agents`)."""

    ROLE = "rollout.multi_turn"

    enable: bool = key(Bool())
    max_turns: int = key(Int(1, note="policy turns per trajectory"))
    # names or package.module:Class, comma-separated (`hfjax.tools.registry`)
    tools: str = key(Check(checks.tool_spec))
    max_tool_response_len: int = key(Int(1, note="tokens per observation"))
    tool_workers: int = key(Int(1, note="worker processes running tool calls"))
    # the calls of a turn run in order
    max_parallel_calls: int = key(Int(1, note="tool calls per policy turn"))
    python_isolation: str = key(Choice(
        ("jail", "none"), note="the python tool's OS jail (hfjax/tools/jail.py); none runs the "
        "policy's code without it, accepting the risk"), default="jail")

    def tool_options(self) -> dict[str, dict]:
        """`resolve_tools`' options for the tools of this spec."""
        return {"python": {"isolation": self.python_isolation}}


@dataclasses.dataclass(frozen=True)
class RolloutSpec(Spec):
    """How the actor generates: the config's `rollout` section (docs/architecture.md), read
    where the worker groups are built and handed to the sampler's builder
    (`hfjax.engine.continuous.rollout_sampler`), the actor and the critics.

    `decode_mesh` answers the one question "does the actor reshard for decoding?", here and
    nowhere else.
    """

    ROLE = "rollout"

    n: int = key(Int(1))  # samples per prompt
    response_length: int = key(Int(1))
    temperature: float = key(Float(0.0, lo_open=True,
                                   note="training log-probs are divided by it; greedy "
                                        "validation is rollout.val_kwargs.temperature=0"))
    top_k: int = key(Int(0, note="0: off"))
    top_p: float = key(Float(0.0, 1.0, lo_open=True, note="1.0: off"))
    min_p: float = key(Float(0.0, 1.0, hi_open=True, note="0.0: off"))
    # the 3D-HybridEngine's decode mesh; "": decode in the training layout
    mesh: str = key(Check(checks.mesh(optional=True)))
    hybrid_engine: bool = key(Bool())
    offload_optimizer: bool = key(Bool())
    mode: str = key(Choice(("static", "continuous"),
                           note="continuous: decode slots refilled as rows stop"))
    decode_attention: str = key(Choice(("auto", "full", "chunked", "pallas"),
                                       note="auto: full on CPU and TPU, pallas on GPU; "
                                       "chunked where pallas cannot run "
                                       "(hfjax.models.backend.decode_choice)"))
    kv_layout: str = key(Choice(("auto", "cpu", "gpu"),
                                note="auto: cpu on CPU, gpu on GPU and TPU"))
    slots: int = key(Int(0, note="0: one per sample"))
    refill_every: int = key(Int(1))
    min_slots: int = key(Int(0, note="0: the start of the slots' row range"))
    max_cache_len: int = key(Int(0, note="0: no limit"))
    multi_turn: MultiTurnSpec

    @property
    def decode_mesh(self) -> str:
        """The hybrid engine's decode mesh: "" when `hybrid_engine` is off or `mesh` is
        empty (the actor decodes in its training layout)."""
        return self.mesh if self.hybrid_engine else ""
