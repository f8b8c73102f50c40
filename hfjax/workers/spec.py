"""The roles' settings as typed, frozen values: what the actor, the critics and the learned
score models read from their config sections.

`hfjax.workers.groups` builds each spec once from the run's config (`ActorSpec.of(cfg.actor)`,
...) and hands it to the worker group; workers read the spec's fields, never a config's keys.
A spec has no defaults of its own: the defaults are the config's (configs/ppo_arith.py, from
which every config derives, and whose every key `hfjax.config.check_config` asks for), so a
section without one of the spec's keys is refused here, by name. Values are checked for their
type here too (a string where an int belongs fails now, not inside a jitted step); their
ranges and names are the key table's checks (`hfjax.config.keys`), run before this.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

from hfjax.engine import packing, shared_prompt

S = TypeVar("S")

_TYPES = {int: "an int", float: "a float", bool: "True or False", str: "a string"}


def _value(role: str, name: str, v: Any, kind: type) -> Any:
    """`v` as `kind`, or a ValueError naming the key `role.name` and the fix."""
    if kind is bool:
        ok = isinstance(v, bool)
    elif kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    else:
        ok = isinstance(v, kind)
    if not ok:
        raise ValueError(f"{role}.{name}={v!r} needs {_TYPES[kind]}; set "
                         f"--config.{role}.{name} to one")
    return kind(v)


def _of(cls: type[S], section: Any, role: str) -> S:
    """The spec `cls` read from a config section (a ConfigDict or a mapping) of role `role`:
    every field is the key of its name, which the section must have."""
    if isinstance(section, cls):
        return section
    if section is None:
        raise ValueError(f"the config has no {role} section; derive the config from "
                         "configs/ppo_arith.py")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in section:
            raise ValueError(f"the config's {role} section has no key {f.name}; derive the "
                             f"config from configs/ppo_arith.py, or set --config.{role}."
                             f"{f.name}")
        values[f.name] = _value(role, f.name, section[f.name], hints[f.name])
    return cls(**values)


class _Spec:
    """`of`: a spec read from its role's config section (`ROLE` unless another is named)."""

    ROLE: typing.ClassVar[str]

    @classmethod
    def of(cls: type[S], section: Any, role: str | None = None) -> S:
        """`section` itself when it is already this spec, else the spec of a config section."""
        return _of(cls, section, role or cls.ROLE)


@dataclasses.dataclass(frozen=True)
class _UpdateSpec(_Spec):
    """The fields a trained role's passes share: batch sizes and epochs, the micro-batch layout
    (padded or packed rows, length grouping) and how the loss is aggregated."""

    ppo_mini_batch_size: int  # prompts; times rollout.n sequences
    ppo_micro_batch_size: int  # sequences
    ppo_epochs: int
    shuffle: bool
    use_remove_padding: bool
    ppo_max_token_len_per_gpu: int
    group_by_length: bool
    loss_agg_mode: str

    @property
    def budget(self) -> packing.TokenBudget | None:
        """The packed rows' token budget; None: padded rows (`use_remove_padding` off)."""
        return packing.token_budget(self.use_remove_padding, self.ppo_max_token_len_per_gpu,
                                    self.ppo_micro_batch_size)


@dataclasses.dataclass(frozen=True)
class ActorSpec(_UpdateSpec):
    """What the actor's scoring passes and PPO-style update read (the `actor` section): the
    shared fields, shared-prompt rows, LM-head chunks and the policy loss with its clip,
    entropy and KL terms. The reference scores in the actor's layout, so it reads the layout
    fields too."""

    ROLE = "actor"

    share_prompt: bool
    logprob_chunk: int
    policy_loss: str
    clip_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str

    def samples_per_row(self, n: int) -> int:
        """The samples a shared-prompt row holds with `n` samples per prompt (1: none)."""
        return shared_prompt.samples_per_row(n, self.ppo_micro_batch_size,
                                             share=self.share_prompt,
                                             packed=self.use_remove_padding)


@dataclasses.dataclass(frozen=True)
class CriticSpec(_UpdateSpec):
    """What a value critic's passes and update read (the `critic` or `cost_critic` section):
    the shared fields and the value clip."""

    ROLE = "critic"

    cliprange_value: float


@dataclasses.dataclass(frozen=True)
class ScoreSpec(_Spec):
    """What a learned reward or cost model is built and scores with (the `reward_model` or
    `cost_model` section): its dtype and its packing."""

    ROLE = "reward_model"

    path: str
    dtype: str
    use_remove_padding: bool
    forward_max_token_len_per_gpu: int

    @property
    def budget(self) -> packing.TokenBudget | None:
        """The packed rows' token budget (0: the whole batch's padded tokens); None: padded
        rows."""
        return packing.token_budget(self.use_remove_padding, self.forward_max_token_len_per_gpu)
