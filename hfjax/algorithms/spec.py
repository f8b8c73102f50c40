"""What an algorithm driver's step reads, as typed, frozen values: `StepSpec`, the algorithm's
settings (`AlgoSpec`, the config's `algo` section) with the rollout's (`RolloutSpec`).

The run loop builds it once (`StepSpec.of(cfg)`) and hands it to every step; drivers and the
stages they share read its fields, never a config's keys. It is read like the other specs
(`hfjax.engine.spec.Spec.of`): no defaults of its own, a missing key or a value of the wrong
type refused by name. The controllers' settings (`algo.kl_ctrl`, `algo.safe_rlhf`) are read
where the worker groups are built (`hfjax.workers.groups`), which holds the controllers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hfjax.engine.spec import RolloutSpec, Spec
from hfjax.numerics.rollout_correction import RolloutCorrection, level_in_force, resolve
from hfjax.settings import Bool, Check, Choice, Float, Int, checks, key

_FRACTION = Float(0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class FilterGroupsSpec(Spec):
    """DAPO's dynamic sampling (`algo.filter_groups`)."""

    ROLE = "algo.filter_groups"

    enable: bool = key(Bool())
    max_num_gen_batches: int = key(Int(0, note="0: no cap"))
    on_exhausted: str = key(Choice(("error", "fill")))


@dataclasses.dataclass(frozen=True)
class OverlongSpec(Spec):
    """DAPO's overlong reward shaping (`algo.overlong_buffer`)."""

    ROLE = "algo.overlong_buffer"

    enable: bool = key(Bool())
    len: int = key(Int(1))
    penalty_factor: float = key(Float(0.0))


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionSpec(Spec):
    """Rollout correction between the sampler's and the trainer's log-probs
    (`algo.rollout_correction`, verl's names; `hfjax.numerics.rollout_correction`)."""

    ROLE = "algo.rollout_correction"

    # "auto": token-level when async_rollout.max_staleness >= 1 (not in bypass mode), else off
    rollout_is: str = key(Check(checks.level_or_off(("token", "sequence"), auto=True)))
    # upper truncation of the importance weights
    rollout_is_threshold: float = key(Float(0.0, lo_open=True))
    rollout_rs: str = key(Check(checks.level_or_off(("token", "sequence", "geometric"))))
    rollout_rs_threshold: float = key(Float(0.0, note="0: rollout_is_threshold"))
    rollout_rs_threshold_lower: float = key(
        Float(0.0, note="0: the reciprocal of the upper threshold"))
    rollout_token_veto_threshold: float = key(Float(0.0, 1.0, note="0: no veto"))
    # the rollout's log-probs are the old policy's; no old-log-prob pass
    bypass_mode: bool = key(Bool())

    def in_force(self, max_staleness: int) -> RolloutCorrectionSpec:
        """This spec with `rollout_is` the level a run with staleness bound `max_staleness`
        applies ("auto" and "none" resolved, `level_in_force`)."""
        return dataclasses.replace(self, rollout_is=level_in_force(
            self.rollout_is, max_staleness, self.bypass_mode))

    @property
    def resolved(self) -> RolloutCorrection:
        """The settings in force (defaults filled in), as the numerics take them."""
        return resolve(self.rollout_is, self.rollout_is_threshold, self.rollout_rs,
                       self.rollout_rs_threshold, self.rollout_rs_threshold_lower,
                       self.rollout_token_veto_threshold)


@dataclasses.dataclass(frozen=True)
class DistillSpec(Spec):
    """On-policy distillation's term (`algo.distill`, `hfjax.numerics.distill`): the teacher's
    per-token reverse-KL advantage, times `coef`, added to the estimator's."""

    ROLE = "algo.distill"

    coef: float = key(Float(0.0, note="0: off; > 0 builds the teacher (teacher.path)"))
    discount: float = key(Float(0.0, 1.0, note="0: each token's own term"))


@dataclasses.dataclass(frozen=True)
class AlgoSpec(Spec):
    """The advantage stage's settings and DAPO's sampling and shaping (the `algo` section)."""

    ROLE = "algo"

    adv_estimator: str = key(Choice(checks.registry("ADV_ESTIMATORS")))
    gamma: float = key(_FRACTION)
    lam: float = key(_FRACTION)
    norm_adv_by_std_in_grpo: bool = key(Bool())
    use_kl_in_reward: bool = key(Bool())
    kl_penalty: str = key(Choice(checks.kl_names))
    filter_groups: FilterGroupsSpec
    overlong_buffer: OverlongSpec
    rollout_correction: RolloutCorrectionSpec
    distill: DistillSpec


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """A driver's settings: `algo` and `rollout` (samples per prompt `rollout.n`, the
    response budget `rollout.response_length`, ...). Its rollout correction is the one in
    force: `rollout_is="auto"` is resolved against `async_rollout.max_staleness`."""

    algo: AlgoSpec
    rollout: RolloutSpec

    @classmethod
    def of(cls, cfg: Any) -> StepSpec:
        """`cfg` itself when it is already a StepSpec, else the spec of a run's config."""
        if isinstance(cfg, cls):
            return cfg
        algo = AlgoSpec.of(cfg.algo)
        k = cfg.async_rollout.max_staleness if "async_rollout" in cfg else 0
        algo = dataclasses.replace(algo, rollout_correction=algo.rollout_correction.in_force(k))
        return cls(algo, RolloutSpec.of(cfg.rollout))

    @classmethod
    def require(cls, value: Any, owner: str) -> None:
        """TypeError unless `value` (`owner`'s settings argument) is a StepSpec, naming the
        fix."""
        if not isinstance(value, cls):
            raise TypeError(f"{owner}: the settings argument is a {type(value).__name__}, not "
                            "the StepSpec it needs; build it once with "
                            "hfjax.algorithms.spec.StepSpec.of(cfg)")
