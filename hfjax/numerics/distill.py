"""On-policy distillation's numerics: the per-token reverse-KL advantage against a teacher.

The student samples; the teacher scores every sampled token. The per-token reward is
-(log pi_student - log pi_teacher) of the sampled token (the reverse KL's single-sample
estimate, as Thinking Machines' and NeMo-RL's on-policy distillation define it), and its
advantage is that reward (discount 0) or its discounted sum over the later tokens of the row.
Tokens outside the mask (padding, a multi-turn row's tool tokens) carry no reward and do not
break the discounted chain. The term is added, times `algo.distill.coef`, to whatever advantage
the run's estimator gives; `--config.algorithm=opd` uses the `distill` estimator, which gives
none, so the term is the whole advantage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.numerics.advantages import AdvantageInputs
from hfjax.numerics.core import ADV_ESTIMATORS, mask_like

Array = jax.Array


def reverse_kl_advantage(student_log_prob: Array, teacher_log_prob: Array, response_mask: Array,
                         discount: float) -> Array:
    """The per-token distillation advantage [B, T]: log pi_teacher - log pi_student on masked
    tokens, summed over the row's later masked tokens with `discount` (0: the token's own)."""
    m = mask_like(response_mask, student_log_prob)
    reward = (teacher_log_prob - student_log_prob) * m
    if discount == 0.0:
        return reward

    def back(carry, xs):
        r, keep = xs
        value = jnp.where(keep > 0, r + discount * carry, carry)
        return value, value

    _, out = jax.lax.scan(back, jnp.zeros(reward.shape[0], reward.dtype),
                          (reward.T, m.T), reverse=True)
    return out.T * m


@ADV_ESTIMATORS.register("distill")
def compute_distill_only_advantage(x: AdvantageInputs) -> tuple[Array, Array]:
    """On-policy distillation's estimator: no advantage from rewards (zeros; the rewards are
    only reported), so the reverse-KL term of `algo.distill` is the whole advantage.

    Returns (advantages, returns), each ``[B, T]`` of zeros."""
    zeros = jnp.zeros_like(x.token_level_rewards)
    return zeros, zeros
