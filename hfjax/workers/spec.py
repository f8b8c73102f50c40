"""The roles' settings as typed, frozen values: what the actor, the critics and the learned
score models read from their config sections.

`hfjax.workers.groups` builds each spec once from the run's config (`ActorSpec.of(cfg.actor)`,
...) and hands it to the worker group; workers read the spec's fields, never a config's keys.
The specs are read as the rollout's is (`hfjax.engine.spec.Spec.of`): no defaults of their
own, a missing key or a value of the wrong type refused by name.
"""

from __future__ import annotations

import dataclasses

from hfjax.engine import packing, shared_prompt
from hfjax.engine.spec import Spec
from hfjax.settings import Bool, Check, Choice, Float, Int, checks, key

_BUDGET = ("tokens per data-parallel device and micro-batch with use_remove_padding; "
           "0: ppo_micro_batch_size padded rows")
_FORWARD_BUDGET = ("tokens per data-parallel device and micro-batch of the scoring pass with "
                   "use_remove_padding; 0: the whole batch")
_CLIP = Float(0.0)


@dataclasses.dataclass(frozen=True)
class _UpdateSpec(Spec):
    """The fields a trained role's passes share: batch sizes and epochs, the micro-batch layout
    (padded or packed rows, length grouping) and how the loss is aggregated."""

    ppo_mini_batch_size: int = key(Int(1))  # prompts; times rollout.n sequences
    ppo_micro_batch_size: int = key(Int(1))  # sequences
    ppo_epochs: int = key(Int(1))
    shuffle: bool = key(Bool())
    use_remove_padding: bool = key(Bool())
    ppo_max_token_len_per_gpu: int = key(Int(0, note=_BUDGET))
    group_by_length: bool = key(Bool())
    loss_agg_mode: str = key(Choice(checks.registry("LOSS_AGG_MODES")))

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

    share_prompt: bool = key(Bool())
    logprob_chunk: int = key(Int(0, note="positions per data-parallel device the LM head "
                                         "takes at a time in log-probs and entropy (0: whole "
                                         "rows)"))
    policy_loss: str = key(Choice(checks.registry("POLICY_LOSSES")))
    clip_ratio: float = key(_CLIP)
    clip_ratio_low: float = key(_CLIP)
    clip_ratio_high: float = key(_CLIP)
    clip_ratio_c: float = key(Float(1.0, lo_open=True, note="the dual-clip bound"))
    entropy_coeff: float = key(Float())
    use_kl_loss: bool = key(Bool())
    kl_loss_coef: float = key(Float(0.0))
    kl_loss_type: str = key(Choice(checks.kl_names))
    # A mixture of experts' router losses (`hfjax.models.moe.RouterStats`), averaged over its
    # sparse layers; a dense model has none and ignores them.
    moe_aux_loss_coef: float = key(Float(0.0, note="the load-balancing loss's weight "
                                         "(Switch / Qwen form: k when balanced)"))
    moe_z_loss_coef: float = key(Float(0.0, note="the router z-loss's weight"))
    # Routing replay (`hfjax.workers.routing`): none | r2 (the old-policy log-probs route as
    # the sampler did) | r3 (the update too).
    router_replay: str = key(Choice(("none", "r2", "r3")))

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

    cliprange_value: float = key(Float(0.0, lo_open=True))


@dataclasses.dataclass(frozen=True)
class ScoreSpec(Spec):
    """What a learned reward or cost model is built and scores with (the `reward_model` or
    `cost_model` section): its dtype and its packing."""

    ROLE = "reward_model"

    path: str = key(Check(checks.model_path(optional=True)))
    dtype: str = key(Choice(("float32", "bfloat16")))
    use_remove_padding: bool = key(Bool())
    forward_max_token_len_per_gpu: int = key(Int(0, note=_FORWARD_BUDGET))

    @property
    def budget(self) -> packing.TokenBudget | None:
        """The packed rows' token budget (0: the whole batch's padded tokens); None: padded
        rows."""
        return packing.token_budget(self.use_remove_padding, self.forward_max_token_len_per_gpu)
