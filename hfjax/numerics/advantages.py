"""Advantage estimators: GAE, GRPO, RLOO, REINFORCE++ (with and without a baseline), ReMax,
and Safe-RLHF's reward-and-cost GAE.

Every estimator takes one `AdvantageInputs` and returns (advantages, returns), both [B, T]
and zero outside ``response_mask``, so padding never leaks into a loss even if a caller forgets
the mask. An estimator with more to hand on (Safe-RLHF's cost returns, for the cost critic)
returns a third element, a dict of further [B, T] arrays the batch gains. An estimator that
needs a new input (a greedy baseline, a cost) adds a field to `AdvantageInputs`; the advantage
stage fills every field the batch can supply. Estimators are registered with the batch arrays
they need beyond rewards and mask (``needs``), so a config whose algorithm does not produce
them is refused before anything runs, and with ``group=True`` when they compare the samples
of one prompt, so a config with one sample per prompt is refused too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hfjax.numerics.core import (
    ADV_ESTIMATORS,
    Array,
    mask_like,
    masked_whiten,
    safe_div,
)


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """Everything an advantage estimator may read.

    Token-level arrays are [B, T]; ``index`` holds int group ids [B] in [0, num_groups) (the
    prompt each sample answers) and ``reward_baselines`` one baseline score per sample [B].
    ``token_level_costs`` and ``cost_values`` are Safe-RLHF's cost-model scores and cost-critic
    values, and ``lagrange_lambda`` its multiplier (a scalar >= 0).
    An estimator raises ValueError when an input it needs is None.
    """

    token_level_rewards: Array
    response_mask: Array
    values: Array | None = None
    index: Array | None = None
    num_groups: int | None = None
    reward_baselines: Array | None = None
    token_level_costs: Array | None = None
    cost_values: Array | None = None
    lagrange_lambda: Array | float | None = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6


def _require(value: Array | None, what: str, estimator: str) -> Array:
    if value is None:
        raise ValueError(f"adv_estimator '{estimator}' needs {what}")
    return value


def _group_stats(scores: Array, index: Array, num_groups: int | None) -> tuple[Array, Array, Array]:
    """Returns per-sample (group size, group mean, unbiased group std), each ``[B]``.

    Groups are int ids in [0, num_groups); segment sums keep this a fixed-shape program with no
    per-group Python loop. ``num_groups`` defaults to B, enough for dense ids 0..G-1 with G <= B.
    Ids outside the range are dropped by the segment ops, so they must be dense.
    """
    index = jnp.asarray(index).astype(jnp.int32)
    g = scores.shape[0] if num_groups is None else int(num_groups)
    count = jax.ops.segment_sum(jnp.ones_like(scores), index, num_segments=g)
    mean = safe_div(jax.ops.segment_sum(scores, index, num_segments=g), count)
    sq_dev = jnp.square(scores - mean[index])
    var = safe_div(jax.ops.segment_sum(sq_dev, index, num_segments=g), count - 1)
    return count[index], mean[index], jnp.sqrt(var)[index]


def _gae(rewards: Array, values: Array, m: Array, gamma: float, lam: float) -> Array:
    """Un-whitened GAE advantages [B, T] of masked rewards and values (see `gae`)."""

    def step(carry, xs):
        next_value, last_adv = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_value - v_t
        adv_t = delta + gamma * lam * last_adv
        next_value = m_t * v_t + (1 - m_t) * next_value
        last_adv = m_t * adv_t + (1 - m_t) * last_adv
        return (next_value, last_adv), last_adv

    zeros = jnp.zeros(rewards.shape[:1], rewards.dtype)
    _, adv_t_major = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, m.T), reverse=True)
    return adv_t_major.T


@ADV_ESTIMATORS.register("gae", needs=("values",))
def compute_gae_advantage_return(x: AdvantageInputs) -> tuple[Array, Array]:
    """Generalised advantage estimation (needs ``values``).

    Tokens outside the mask are skipped by the recursion: the value bootstrap and the running
    advantage pass through them unchanged, so masked tokens in the middle of a response (e.g.
    tool observations) neither bootstrap nor accumulate TD-error. Returns are advantages + values
    taken before the advantages are whitened over the mask.

    Returns (whitened advantages, returns), each ``[B, T]``.
    """
    values = _require(x.values, "values [B, T] from the critic", "gae")
    m = mask_like(x.response_mask, x.token_level_rewards)
    rewards = x.token_level_rewards * m
    values = values.astype(rewards.dtype) * m
    advantages = _gae(rewards, values, m, x.gamma, x.lam)
    returns = (advantages + values) * m
    advantages = masked_whiten(advantages, m) * m
    return advantages, returns


@ADV_ESTIMATORS.register("grpo", group=True)
def compute_grpo_outcome_advantage(x: AdvantageInputs) -> tuple[Array, Array]:
    """GRPO outcome advantage (needs ``index``, the prompt-group id of each sample).

    The score of a sample is the sum of its token rewards. It is normalised within its group:
    (score - mean) / (std + epsilon) with the unbiased std, or only mean-centred when
    ``norm_adv_by_std_in_grpo`` is False (Dr.GRPO). A group of one uses mean 0 and std 1, so its
    advantage is its score / (1 + epsilon) (just its score under Dr.GRPO).

    Returns (advantages, returns), identical, the per-sample value broadcast over the mask.
    """
    index = _require(x.index, "index (int group ids [B])", "grpo")
    m = mask_like(x.response_mask, x.token_level_rewards)
    scores = jnp.sum(x.token_level_rewards, axis=-1)
    count, mean, std = _group_stats(scores, index, x.num_groups)
    single = count <= 1
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    adv = scores - mean
    if x.norm_adv_by_std_in_grpo:
        adv = adv / (std + x.epsilon)
    adv = adv[:, None] * m
    return adv, adv


@ADV_ESTIMATORS.register("rloo", group=True)
def compute_rloo_outcome_advantage(x: AdvantageInputs) -> tuple[Array, Array]:
    """REINFORCE leave-one-out advantage (needs ``index``).

    Each sample's baseline is the mean score of the *other* samples of its group, which equals
    n/(n-1) * (score - group mean). A group of one has no baseline and keeps its raw score.

    Returns (advantages, returns), identical, broadcast over the mask.
    """
    index = _require(x.index, "index (int group ids [B])", "rloo")
    m = mask_like(x.response_mask, x.token_level_rewards)
    scores = jnp.sum(x.token_level_rewards, axis=-1)
    count, mean, _ = _group_stats(scores, index, x.num_groups)
    loo = (scores - mean) * safe_div(count, count - 1)
    adv = jnp.where(count > 1, loo, scores)[:, None] * m
    return adv, adv


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(x: AdvantageInputs) -> tuple[Array, Array]:
    """REINFORCE++: discounted return-to-go, whitened over the whole batch's mask.

    Tokens outside the mask are context, not steps: the running return passes through them
    unchanged (not discounted, not restarted), so a score on the last policy turn reaches the
    earlier turns across the tool results between them, as in `gae`. Rewards on masked tokens
    are dropped, so padding after the response adds nothing.

    Returns (whitened returns as advantages, returns), each ``[B, T]``.
    """
    m = mask_like(x.response_mask, x.token_level_rewards)
    gamma = x.gamma

    def step(running, xs):
        r_t, m_t = xs
        ret_t = r_t * m_t + gamma * running
        running = m_t * ret_t + (1 - m_t) * running
        return running, ret_t

    zeros = jnp.zeros(x.token_level_rewards.shape[:1], m.dtype)
    _, ret_t_major = jax.lax.scan(step, zeros, (x.token_level_rewards.T, m.T), reverse=True)
    returns = ret_t_major.T
    advantages = masked_whiten(returns, m) * m
    return advantages, returns * m


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline", group=True)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    x: AdvantageInputs,
) -> tuple[Array, Array]:
    """REINFORCE++ with a group-mean baseline (needs ``index``).

    The score minus its group mean (0 for a group of one) is broadcast over the mask, then
    whitened over the whole batch's mask.

    Returns (advantages, returns), identical, each ``[B, T]``.
    """
    index = _require(x.index, "index (int group ids [B])", "reinforce_plus_plus_baseline")
    m = mask_like(x.response_mask, x.token_level_rewards)
    scores = jnp.sum(x.token_level_rewards, axis=-1)
    count, mean, _ = _group_stats(scores, index, x.num_groups)
    centred = (scores - jnp.where(count <= 1, 0.0, mean))[:, None] * m
    adv = masked_whiten(centred, m) * m
    return adv, adv


@ADV_ESTIMATORS.register("remax", needs=("reward_baselines",))
def compute_remax_outcome_advantage(x: AdvantageInputs) -> tuple[Array, Array]:
    """ReMax (needs ``reward_baselines`` [B], the score of the greedy response to each prompt).

    Returns are the undiscounted return-to-go of the masked rewards; advantages subtract the
    baseline score from every response token. With an outcome reward on the last token this is
    score - baseline on every token.

    Returns (advantages, returns), each ``[B, T]``.
    """
    baselines = _require(x.reward_baselines, "reward_baselines [B] (greedy scores)", "remax")
    m = mask_like(x.response_mask, x.token_level_rewards)
    masked = x.token_level_rewards * m
    # The cumulative sum also fills tool tokens inside the response: masked after it, so they
    # get no advantage (they are context, not the policy's).
    returns = jnp.flip(jnp.cumsum(jnp.flip(masked, axis=-1), axis=-1), axis=-1) * m
    advantages = returns - baselines[:, None].astype(returns.dtype) * m
    return advantages, returns


@ADV_ESTIMATORS.register("safe_rlhf", needs=("values", "cost_values", "token_level_costs"))
def compute_safe_rlhf_advantage(x: AdvantageInputs) -> tuple[Array, Array, dict[str, Array]]:
    """Safe-RLHF: GAE on the rewards with the reward critic's values and on the costs with the
    cost critic's, combined as (A_r - lambda * A_c) / (1 + lambda) (needs ``values``,
    ``cost_values``, ``token_level_costs`` and ``lagrange_lambda``).

    The two GAE terms are combined un-whitened, so the multiplier weighs reward and cost in
    their own units; the combination is then whitened over the mask, as `gae` whitens its
    advantages, so the actor's step size does not depend on the scale of either model.

    Returns (advantages, reward returns, {"cost_returns", "cost_advantages"}), each [B, T].
    """
    values = _require(x.values, "values [B, T] from the reward critic", "safe_rlhf")
    cost_values = _require(x.cost_values, "cost_values [B, T] from the cost critic", "safe_rlhf")
    costs = _require(x.token_level_costs, "token_level_costs [B, T] from the cost model",
                     "safe_rlhf")
    lam = _require(x.lagrange_lambda, "lagrange_lambda (the multiplier)", "safe_rlhf")
    m = mask_like(x.response_mask, x.token_level_rewards)
    rewards = x.token_level_rewards * m
    values = values.astype(rewards.dtype) * m
    costs = costs.astype(rewards.dtype) * m
    cost_values = cost_values.astype(rewards.dtype) * m
    adv_r = _gae(rewards, values, m, x.gamma, x.lam)
    adv_c = _gae(costs, cost_values, m, x.gamma, x.lam)
    lam = jnp.asarray(lam, rewards.dtype)
    combined = (adv_r - lam * adv_c) / (1.0 + lam)
    advantages = masked_whiten(combined, m) * m
    extra = {"cost_returns": (adv_c + cost_values) * m, "cost_advantages": adv_c * m}
    return advantages, (adv_r + values) * m, extra
