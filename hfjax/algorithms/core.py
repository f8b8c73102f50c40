"""RL numerics for RLHF: advantage estimators, policy and value losses, KL penalties, aggregation.

Everything here is a pure function of arrays: jit-able, no hidden state and no host transfers.
Token-level tensors are ``[B, T]`` (batch, response length) and come with a ``response_mask``
``[B, T]`` (bool or float, 1 marks a response token that counts); sequence-level tensors are
``[B]``. Names, defaults and semantics follow the verl convention so that a verl recipe carries
over unchanged (``adv_estimator``, ``loss_agg_mode``, ``kl_penalty``, ``clip_ratio_c``, ...).

Estimators, policy losses, KL penalties and loss aggregations are registered by name; a driver
looks them up with ``ADV_ESTIMATORS.get(config.adv_estimator)`` and so on.

hfjax convention: every advantage estimator returns zeros outside ``response_mask`` (for both
advantages and returns), so padding never leaks into a loss even if a caller forgets the mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp

Array = jax.Array
F = TypeVar("F", bound=Callable[..., Any])

# Stabilises 1/sqrt(var) when a batch has (almost) constant values.
WHITEN_EPS = 1e-8
# Bounds log-ratios before exp() so one stale token cannot overflow the ratio to inf.
LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


class Registry(Generic[F]):
    """Maps names to functions of one kind (e.g. ``adv_estimator``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Returns a decorator that registers a function under ``names`` (first name + aliases)."""
        if not names:
            raise ValueError(f"register() for {self.kind} needs at least one name")

        def decorator(fn: F) -> F:
            for name in names:
                if name in self._fns:
                    raise ValueError(f"{self.kind} '{name}' is already registered")
                self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """Returns the function registered as ``name``; raises ValueError listing known names."""
        try:
            return self._fns[name]
        except KeyError:
            known = ", ".join(self.names())
            raise ValueError(f"unknown {self.kind} '{name}'; known: {known}") from None

    def names(self) -> tuple[str, ...]:
        """Returns the registered names, sorted."""
        return tuple(sorted(self._fns))

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"


ADV_ESTIMATORS: Registry[Callable[..., tuple[Array, Array]]] = Registry("adv_estimator")
POLICY_LOSSES: Registry[Callable[..., tuple[Array, Array, Array, Array]]] = Registry("policy_loss")
KL_PENALTIES: Registry[Callable[[Array, Array], Array]] = Registry("kl_penalty")
LOSS_AGG_MODES: Registry[Callable[..., Array]] = Registry("loss_agg_mode")


# --------------------------------------------------------------------------------------------
# Masked statistics and logit utilities
# --------------------------------------------------------------------------------------------


def _mask_like(mask: Array, values: Array) -> Array:
    return jnp.asarray(mask).astype(jnp.result_type(values, jnp.float32))


def _safe_div(num: Array, den: Array) -> Array:
    # 0 (not nan) for an empty mask: fully padded rows are normal after batch padding.
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), 0)


def masked_sum(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Returns the sum of ``values`` where ``mask`` is set, over ``axis`` (all axes if None)."""
    return jnp.sum(values * _mask_like(mask, values), axis=axis)


def masked_mean(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Returns the mean of ``values`` over the masked entries along ``axis``; 0 if none are set."""
    m = _mask_like(mask, values)
    return _safe_div(jnp.sum(values * m, axis=axis), jnp.sum(m, axis=axis))


def masked_var(values: Array, mask: Array, unbiased: bool = True) -> Array:
    """Returns the variance of the masked entries (all axes).

    With ``unbiased`` the Bessel factor n/(n-1) is applied; a single masked entry gives 0 rather
    than an error, since a jitted program cannot raise on data.
    """
    m = _mask_like(mask, values)
    mean = masked_mean(values, m)
    var = masked_mean(jnp.square(values - mean), m)
    if unbiased:
        n = jnp.sum(m)
        var = var * _safe_div(n, n - 1)
    return var


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True) -> Array:
    """Returns ``values`` normalised to zero mean and unit (unbiased) variance over the mask.

    With ``shift_mean=False`` the mean is added back, so only the scale changes.
    """
    m = _mask_like(mask, values)
    mean = masked_mean(values, m)
    whitened = (values - mean) * jax.lax.rsqrt(masked_var(values, m) + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: Array) -> Array:
    """Returns the entropy of softmax(logits) over the last axis, in float32 (shape ``[...]``).

    Computed as -sum p log p with log p from logsumexp, which stays accurate for large logits and
    finite for -inf logits (masked vocabulary entries).
    """
    logits = logits.astype(jnp.float32)
    logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    p = jnp.exp(logp)
    # p == 0 exactly where logits are -inf; 0 * -inf would be nan.
    return -jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, logp, 0.0), 0.0), axis=-1)


def logprobs_from_logits(logits: Array, labels: Array) -> Array:
    """Returns log softmax(logits)[..., label] in float32, shape ``labels.shape``.

    Only the chosen entry and the logsumexp are formed, so the full log-softmax over the
    vocabulary never needs to be kept.
    """
    logits = logits.astype(jnp.float32)
    # Shifting by the max before subtracting keeps precision when logits are large: picked and
    # logsumexp would otherwise both be ~max and cancel in float32.
    logits = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    picked = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


# --------------------------------------------------------------------------------------------
# Advantage estimators
#
# All share one keyword-only signature so a driver can call any of them with the same config;
# an estimator raises ValueError when an input it needs (values, index, reward_baselines) is
# missing. They return (advantages, returns), both [B, T] and zero outside response_mask.
# --------------------------------------------------------------------------------------------


def _require(value: Array | None, what: str, estimator: str) -> Array:
    if value is None:
        raise ValueError(f"adv_estimator '{estimator}' needs {what}; pass it as a keyword")
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
    mean = _safe_div(jax.ops.segment_sum(scores, index, num_segments=g), count)
    sq_dev = jnp.square(scores - mean[index])
    var = _safe_div(jax.ops.segment_sum(sq_dev, index, num_segments=g), count - 1)
    return count[index], mean[index], jnp.sqrt(var)[index]


@ADV_ESTIMATORS.register("gae")
def compute_gae_advantage_return(
    *,
    token_level_rewards: Array,
    response_mask: Array,
    values: Array | None = None,
    index: Array | None = None,
    num_groups: int | None = None,
    reward_baselines: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Array, Array]:
    """Generalised advantage estimation (needs ``values``).

    Tokens outside the mask are skipped by the recursion: the value bootstrap and the running
    advantage pass through them unchanged, so masked tokens in the middle of a response (e.g.
    tool observations) neither bootstrap nor accumulate TD-error. Returns are advantages + values
    taken before the advantages are whitened over the mask.

    Returns (whitened advantages, returns), each ``[B, T]``.
    """
    values = _require(values, "values [B, T] from the critic", "gae")
    m = _mask_like(response_mask, token_level_rewards)
    rewards = token_level_rewards * m
    values = values.astype(rewards.dtype) * m

    def step(carry, x):
        next_value, last_adv = carry
        r_t, v_t, m_t = x
        delta = r_t + gamma * next_value - v_t
        adv_t = delta + gamma * lam * last_adv
        next_value = m_t * v_t + (1 - m_t) * next_value
        last_adv = m_t * adv_t + (1 - m_t) * last_adv
        return (next_value, last_adv), last_adv

    zeros = jnp.zeros(rewards.shape[:1], rewards.dtype)
    _, adv_t_major = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, m.T), reverse=True)
    advantages = adv_t_major.T
    returns = (advantages + values) * m
    advantages = masked_whiten(advantages, m) * m
    return advantages, returns


@ADV_ESTIMATORS.register("grpo")
def compute_grpo_outcome_advantage(
    *,
    token_level_rewards: Array,
    response_mask: Array,
    values: Array | None = None,
    index: Array | None = None,
    num_groups: int | None = None,
    reward_baselines: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Array, Array]:
    """GRPO outcome advantage (needs ``index``, the prompt-group id of each sample).

    The score of a sample is the sum of its token rewards. It is normalised within its group:
    (score - mean) / (std + epsilon) with the unbiased std, or only mean-centred when
    ``norm_adv_by_std_in_grpo`` is False (Dr.GRPO). A group of one uses mean 0 and std 1, so its
    advantage is its score / (1 + epsilon) (just its score under Dr.GRPO).

    Returns (advantages, returns), identical, the per-sample value broadcast over the mask.
    """
    index = _require(index, "index (int group ids [B])", "grpo")
    m = _mask_like(response_mask, token_level_rewards)
    scores = jnp.sum(token_level_rewards, axis=-1)
    count, mean, std = _group_stats(scores, index, num_groups)
    single = count <= 1
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = adv[:, None] * m
    return adv, adv


@ADV_ESTIMATORS.register("rloo")
def compute_rloo_outcome_advantage(
    *,
    token_level_rewards: Array,
    response_mask: Array,
    values: Array | None = None,
    index: Array | None = None,
    num_groups: int | None = None,
    reward_baselines: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Array, Array]:
    """REINFORCE leave-one-out advantage (needs ``index``).

    Each sample's baseline is the mean score of the *other* samples of its group, which equals
    n/(n-1) * (score - group mean). A group of one has no baseline and keeps its raw score.

    Returns (advantages, returns), identical, broadcast over the mask.
    """
    index = _require(index, "index (int group ids [B])", "rloo")
    m = _mask_like(response_mask, token_level_rewards)
    scores = jnp.sum(token_level_rewards, axis=-1)
    count, mean, _ = _group_stats(scores, index, num_groups)
    loo = (scores - mean) * _safe_div(count, count - 1)
    adv = jnp.where(count > 1, loo, scores)[:, None] * m
    return adv, adv


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    *,
    token_level_rewards: Array,
    response_mask: Array,
    values: Array | None = None,
    index: Array | None = None,
    num_groups: int | None = None,
    reward_baselines: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Array, Array]:
    """REINFORCE++: discounted return-to-go, whitened over the whole batch's mask.

    The running return restarts after every masked-out token, so rewards beyond the end of a
    response (or beyond a masked span) never flow back into it.

    Returns (whitened returns as advantages, returns), each ``[B, T]``.
    """
    m = _mask_like(response_mask, token_level_rewards)

    def step(running, x):
        r_t, m_t = x
        ret_t = r_t + gamma * running
        return ret_t * m_t, ret_t

    zeros = jnp.zeros(token_level_rewards.shape[:1], m.dtype)
    _, ret_t_major = jax.lax.scan(step, zeros, (token_level_rewards.T, m.T), reverse=True)
    returns = ret_t_major.T
    advantages = masked_whiten(returns, m) * m
    return advantages, returns * m


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    *,
    token_level_rewards: Array,
    response_mask: Array,
    values: Array | None = None,
    index: Array | None = None,
    num_groups: int | None = None,
    reward_baselines: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Array, Array]:
    """REINFORCE++ with a group-mean baseline (needs ``index``).

    The score minus its group mean (0 for a group of one) is broadcast over the mask, then
    whitened over the whole batch's mask.

    Returns (advantages, returns), identical, each ``[B, T]``.
    """
    index = _require(index, "index (int group ids [B])", "reinforce_plus_plus_baseline")
    m = _mask_like(response_mask, token_level_rewards)
    scores = jnp.sum(token_level_rewards, axis=-1)
    count, mean, _ = _group_stats(scores, index, num_groups)
    centred = (scores - jnp.where(count <= 1, 0.0, mean))[:, None] * m
    adv = masked_whiten(centred, m) * m
    return adv, adv


@ADV_ESTIMATORS.register("remax")
def compute_remax_outcome_advantage(
    *,
    token_level_rewards: Array,
    response_mask: Array,
    values: Array | None = None,
    index: Array | None = None,
    num_groups: int | None = None,
    reward_baselines: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Array, Array]:
    """ReMax (needs ``reward_baselines`` [B], the score of the greedy response to each prompt).

    Returns are the undiscounted return-to-go of the masked rewards; advantages subtract the
    baseline score from every response token. With an outcome reward on the last token this is
    score - baseline on every token.

    Returns (advantages, returns), each ``[B, T]``.
    """
    baselines = _require(reward_baselines, "reward_baselines [B] (greedy scores)", "remax")
    m = _mask_like(response_mask, token_level_rewards)
    masked = token_level_rewards * m
    returns = jnp.flip(jnp.cumsum(jnp.flip(masked, axis=-1), axis=-1), axis=-1)
    advantages = returns - baselines[:, None].astype(returns.dtype) * m
    return advantages, returns


# --------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------


@LOSS_AGG_MODES.register("token-mean")
def _agg_token_mean(loss_mat: Array, m: Array, loss_scale_factor: float | None) -> Array:
    return masked_mean(loss_mat, m)


def _valid_rows(m: Array) -> Array:
    # Fully masked rows (batch padding) are left out of the mean over sequences.
    return (jnp.sum(m, axis=-1) > 0).astype(m.dtype)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _agg_seq_mean_token_sum(loss_mat: Array, m: Array, loss_scale_factor: float | None) -> Array:
    return masked_mean(masked_sum(loss_mat, m, axis=-1), _valid_rows(m))


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _agg_seq_mean_token_mean(loss_mat: Array, m: Array, loss_scale_factor: float | None) -> Array:
    return masked_mean(masked_mean(loss_mat, m, axis=-1), _valid_rows(m))


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _agg_seq_mean_token_sum_norm(
    loss_mat: Array, m: Array, loss_scale_factor: float | None
) -> Array:
    # A constant divisor (the response horizon by default) makes every token weigh the same
    # regardless of its sequence's length (the Dr.GRPO normalisation).
    scale = m.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return masked_sum(loss_mat, m) / scale


def agg_loss(
    loss_mat: Array,
    loss_mask: Array,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> Array:
    """Reduces a ``[B, T]`` loss matrix to a scalar.

    Modes: "token-mean" (mean over all masked tokens), "seq-mean-token-sum" (per-sequence sum,
    then mean over sequences), "seq-mean-token-mean" (per-sequence mean, then mean over
    sequences), "seq-mean-token-sum-norm" (total masked sum / ``loss_scale_factor``, default T).
    Sequence means skip rows with no masked tokens.

    Returns the scalar loss.
    """
    fn = LOSS_AGG_MODES.get(loss_agg_mode)
    return fn(loss_mat, _mask_like(loss_mask, loss_mat), loss_scale_factor)


# --------------------------------------------------------------------------------------------
# Policy and value losses
# --------------------------------------------------------------------------------------------


def _check_clip_ratio_c(clip_ratio_c: float) -> None:
    if isinstance(clip_ratio_c, int | float) and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")


@POLICY_LOSSES.register("vanilla")
def compute_policy_loss(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Array, Array, Array, Array]:
    """PPO clipped surrogate with dual-clip (token-level ratio).

    Per token: max(-A r, -A clip(r, 1 - cliprange_low, 1 + cliprange_high)); for A < 0 that is
    further capped at -A * clip_ratio_c, which bounds the loss when r explodes on a negative
    advantage. ``cliprange_low``/``cliprange_high`` default to ``cliprange`` (asymmetric clipping
    as in DAPO's clip-higher).

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower): the aggregated loss; the masked
    fraction of tokens where the clipped term is active; the masked mean of
    old_log_prob - log_prob; and the masked fraction where the dual-clip cap is active.
    """
    _check_clip_ratio_c(clip_ratio_c)
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    m = _mask_like(response_mask, log_prob)

    log_ratio = jnp.clip(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, m)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * jnp.clip(ratio, 1 - low, 1 + high)
    loss_ppo = jnp.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).astype(m.dtype), m)

    loss_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(((loss_ppo > loss_cap) & negative).astype(m.dtype), m)
    pg_losses = jnp.where(negative, jnp.minimum(loss_ppo, loss_cap), loss_ppo)

    pg_loss = agg_loss(pg_losses, m, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@POLICY_LOSSES.register("gspo")
def compute_policy_loss_gspo(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
) -> tuple[Array, Array, Array, Array]:
    """GSPO: PPO clipping on a sequence-level importance ratio.

    The sequence ratio is exp(mean over the response of log_prob - old_log_prob), the geometric
    mean of token ratios. Each token carries it with a straight-through form so its value is the
    sequence ratio while the gradient still flows through that token's own log-prob. No dual
    clip (``clip_ratio_c`` is accepted for a uniform signature). GSPO recipes use
    ``loss_agg_mode="seq-mean-token-mean"``, the default here.

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower) with pg_clipfrac_lower = 0.
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    m = _mask_like(response_mask, log_prob)

    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    token_seq_log_ratio = (
        log_prob - jax.lax.stop_gradient(log_prob) + jax.lax.stop_gradient(seq_log_ratio)[:, None]
    )
    ratio = jnp.exp(jnp.minimum(token_seq_log_ratio, 10.0))

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * jnp.clip(ratio, 1 - low, 1 + high)
    pg_losses = jnp.maximum(loss_unclipped, loss_clipped)
    pg_loss = agg_loss(pg_losses, m, loss_agg_mode)
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).astype(m.dtype), m)
    ppo_kl = masked_mean(-log_ratio, m)
    return pg_loss, pg_clipfrac, ppo_kl, jnp.zeros((), pg_loss.dtype)


def compute_value_loss(
    vpreds: Array,
    returns: Array,
    values: Array,
    response_mask: Array,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[Array, Array]:
    """Clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)).

    ``values`` are the critic's predictions at rollout time (v_old).

    Returns (vf_loss, vf_clipfrac): the loss and the masked fraction of tokens where the clipped
    error is the larger one.
    """
    m = _mask_like(response_mask, vpreds)
    vpred_clipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    err_unclipped = jnp.square(vpreds - returns)
    err_clipped = jnp.square(vpred_clipped - returns)
    vf_loss = 0.5 * agg_loss(jnp.maximum(err_unclipped, err_clipped), m, loss_agg_mode)
    vf_clipfrac = masked_mean((err_clipped > err_unclipped).astype(m.dtype), m)
    return vf_loss, vf_clipfrac


# --------------------------------------------------------------------------------------------
# KL penalties
# --------------------------------------------------------------------------------------------


@KL_PENALTIES.register("kl", "k1")
def _kl_k1(logprob: Array, ref_logprob: Array) -> Array:
    return logprob - ref_logprob


@KL_PENALTIES.register("abs")
def _kl_abs(logprob: Array, ref_logprob: Array) -> Array:
    return jnp.abs(logprob - ref_logprob)


@KL_PENALTIES.register("mse", "k2")
def _kl_k2(logprob: Array, ref_logprob: Array) -> Array:
    return 0.5 * jnp.square(logprob - ref_logprob)


@KL_PENALTIES.register("low_var_kl", "k3")
def _kl_k3(logprob: Array, ref_logprob: Array) -> Array:
    # Clamps keep exp() finite and stop one far-off token from dominating the penalty.
    log_ratio = jnp.clip(ref_logprob - logprob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)


def check_kl_name(name: str) -> tuple[str, bool]:
    """(registered base name, straight-through flag) for a KL name such as "k3" or "k3+".

    Raises ValueError listing the known names for an unknown one.
    """
    straight_through = len(name) > 1 and name.endswith("+")
    base = name[:-1] if straight_through else name
    if base not in KL_PENALTIES:
        KL_PENALTIES.get(name)  # raises, listing the known names
    return base, straight_through


def _kl_estimate(logprob: Array, ref_logprob: Array, name: str) -> Array:
    base, straight_through = check_kl_name(name)
    forward = KL_PENALTIES.get(base)(logprob, ref_logprob)
    if not straight_through or base in ("mse", "k2"):
        return forward
    backward = _kl_k2(logprob, ref_logprob)
    return backward - jax.lax.stop_gradient(backward) + jax.lax.stop_gradient(forward)


def kl_penalty(logprob: Array, ref_logprob: Array, kl_penalty: str = "kl") -> Array:
    """Per-token KL estimate between the policy and the reference.

    Names: "kl"/"k1" (log-ratio), "abs", "mse"/"k2" (half squared log-ratio),
    "low_var_kl"/"k3" (exp(-x) + x - 1 on x = logprob - ref_logprob, clamped to [-10, 10]).
    A trailing "+" (e.g. "k3+") keeps the forward value but takes the gradient of k2, an unbiased
    low-variance gradient of the KL when used as a loss.

    Returns the unmasked estimate, shaped like ``logprob``.
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def apply_kl_penalty(
    token_level_scores: Array,
    old_log_prob: Array,
    ref_log_prob: Array,
    response_mask: Array,
    kl_coef: float | Array,
    kl_penalty: str = "kl",
) -> tuple[Array, Array]:
    """Folds a KL penalty into the rewards: rewards = scores - kl_coef * kl * mask.

    Returns (token_level_rewards [B, T], current_kl): current_kl is the batch mean of each
    sequence's masked-mean KL, a device scalar; feed it (once, on the host) to the KL
    controller's ``update`` with n_steps = B.
    """
    m = _mask_like(response_mask, token_level_scores)
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * m
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = jnp.mean(masked_mean(kld, m, axis=-1))
    return token_level_rewards, current_kl


# --------------------------------------------------------------------------------------------
# KL coefficient controllers (host-side, immutable, checkpointable as plain dicts)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FixedKLController:
    """A constant KL coefficient; ``update`` returns the same controller."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> FixedKLController:
        """Returns self: the coefficient never changes."""
        return self


@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., 2019) steering the measured KL to ``target_kl``."""

    value: float
    target_kl: float
    horizon: float

    def update(self, current_kl: float, n_steps: int) -> AdaptiveKLController:
        """Returns a controller whose value is scaled by 1 + clip(kl/target - 1, +-0.2) * n/horizon.

        ``current_kl`` may be a device scalar; converting it here is the step's one deliberate
        host fetch for the controller.
        """
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        mult = 1.0 + error * n_steps / self.horizon
        return dataclasses.replace(self, value=self.value * mult)


def get_kl_controller(
    kl_ctrl_type: str = "fixed",
    kl_coef: float = 0.001,
    target_kl: float = 0.1,
    horizon: float = 10000,
) -> FixedKLController | AdaptiveKLController:
    """Returns the initial KL controller state for ``kl_ctrl_type`` "fixed" or "adaptive"."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(value=kl_coef)
    if kl_ctrl_type == "adaptive":
        if not horizon > 0:
            raise ValueError(f"adaptive kl_ctrl needs horizon > 0, got {horizon}")
        if not target_kl > 0:
            raise ValueError(f"adaptive kl_ctrl needs target_kl > 0, got {target_kl}")
        return AdaptiveKLController(value=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown kl_ctrl type '{kl_ctrl_type}'; known: adaptive, fixed")
