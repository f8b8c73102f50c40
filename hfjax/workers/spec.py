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


@dataclasses.dataclass(frozen=True)
class _UpdateSpec(Spec):
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
class ScoreSpec(Spec):
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
