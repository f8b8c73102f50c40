"""Policy and value losses, the pairwise (Bradley–Terry) loss of reward and cost models, KL
penalties, the KL coefficient controllers and Safe-RLHF's Lagrange multiplier.

Every policy loss takes one `PolicyLossInputs` and returns (pg_loss, pg_clipfrac, ppo_kl,
pg_clipfrac_lower); a loss that needs a new input adds a field there. A loss reduces its
per-token loss with `PolicyLossInputs.aggregate`, never `agg_loss` directly, so per-token
weights (the rollout correction's) apply to every loss.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from hfjax.numerics.core import (
    KL_PENALTIES,
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    Array,
    agg_loss,
    mask_like,
    masked_mean,
    masked_sum,
)

# --------------------------------------------------------------------------------------------
# Policy and value losses
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyLossInputs:
    """Everything a policy loss may read: token-level [B, T] log-probs under the sampling
    (old) and current policy, advantages and the response mask, plus the clipping and
    aggregation settings (verl's names). ``cliprange_low``/``cliprange_high`` default to
    ``cliprange``; ``loss_scale_factor`` is the divisor of "seq-mean-token-sum-norm".

    ``rollout_is_weights`` [B, T] (None: all 1) are per-token weights on the loss, the
    rollout correction's importance weights (`hfjax.numerics.rollout_correction`). Every policy
    loss reduces its per-token loss with `aggregate`, which applies them and the mask, so a
    weight reaches every registered loss the same way; tokens a correction rejects are already
    out of ``response_mask``."""

    old_log_prob: Array
    log_prob: Array
    advantages: Array
    response_mask: Array
    cliprange: float = 0.2
    cliprange_low: float | None = None
    cliprange_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    rollout_is_weights: Array | None = None

    def aggregate(self, loss_mat: Array) -> Array:
        """The scalar loss of a [B, T] per-token loss: weighted by ``rollout_is_weights`` (when
        given), reduced over ``response_mask`` by ``loss_agg_mode``."""
        if self.rollout_is_weights is not None:
            loss_mat = loss_mat * jax.lax.stop_gradient(
                self.rollout_is_weights.astype(loss_mat.dtype))
        return agg_loss(loss_mat, self.response_mask, self.loss_agg_mode,
                        self.loss_scale_factor)

    @property
    def clip_low(self) -> float:
        return self.cliprange if self.cliprange_low is None else self.cliprange_low

    @property
    def clip_high(self) -> float:
        return self.cliprange if self.cliprange_high is None else self.cliprange_high


def _check_clip_ratio_c(clip_ratio_c: float) -> None:
    if isinstance(clip_ratio_c, int | float) and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")


@POLICY_LOSSES.register("vanilla")
def compute_policy_loss(x: PolicyLossInputs) -> tuple[Array, Array, Array, Array]:
    """PPO clipped surrogate with dual-clip (token-level ratio).

    Per token: max(-A r, -A clip(r, 1 - cliprange_low, 1 + cliprange_high)); for A < 0 that is
    further capped at -A * clip_ratio_c, which bounds the loss when r explodes on a negative
    advantage. ``cliprange_low``/``cliprange_high`` default to ``cliprange`` (asymmetric clipping
    as in DAPO's clip-higher).

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower): the aggregated loss; the masked
    fraction of tokens where the clipped term is active; the masked mean of
    old_log_prob - log_prob; and the masked fraction where the dual-clip cap is active.
    """
    _check_clip_ratio_c(x.clip_ratio_c)
    low, high, advantages = x.clip_low, x.clip_high, x.advantages
    m = mask_like(x.response_mask, x.log_prob)

    log_ratio = jnp.clip(x.log_prob - x.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, m)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * jnp.clip(ratio, 1 - low, 1 + high)
    loss_ppo = jnp.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).astype(m.dtype), m)

    loss_cap = -advantages * x.clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(((loss_ppo > loss_cap) & negative).astype(m.dtype), m)
    pg_losses = jnp.where(negative, jnp.minimum(loss_ppo, loss_cap), loss_ppo)

    pg_loss = x.aggregate(pg_losses)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@POLICY_LOSSES.register("gspo")
def compute_policy_loss_gspo(x: PolicyLossInputs) -> tuple[Array, Array, Array, Array]:
    """GSPO: PPO clipping on a sequence-level importance ratio.

    The sequence ratio is exp(mean over the response of log_prob - old_log_prob), the geometric
    mean of token ratios. Each token carries it with a straight-through form so its value is the
    sequence ratio while the gradient still flows through that token's own log-prob. No dual
    clip (``clip_ratio_c`` is not read). GSPO recipes set
    ``loss_agg_mode="seq-mean-token-mean"``.

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower) with pg_clipfrac_lower = 0.
    """
    low, high, advantages, log_prob = x.clip_low, x.clip_high, x.advantages, x.log_prob
    m = mask_like(x.response_mask, log_prob)

    log_ratio = log_prob - x.old_log_prob
    seq_log_ratio = masked_sum(log_ratio, m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    token_seq_log_ratio = (
        log_prob - jax.lax.stop_gradient(log_prob) + jax.lax.stop_gradient(seq_log_ratio)[:, None]
    )
    ratio = jnp.exp(jnp.minimum(token_seq_log_ratio, 10.0))

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * jnp.clip(ratio, 1 - low, 1 + high)
    pg_losses = jnp.maximum(loss_unclipped, loss_clipped)
    pg_loss = x.aggregate(pg_losses)
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
    loss_scale_factor: float | None = None,
) -> tuple[Array, Array]:
    """Clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)).

    ``values`` are the critic's predictions at rollout time (v_old). ``loss_scale_factor`` is
    the divisor of "seq-mean-token-sum-norm" (see `agg_loss`).

    Returns (vf_loss, vf_clipfrac): the loss and the masked fraction of tokens where the clipped
    error is the larger one.
    """
    m = mask_like(response_mask, vpreds)
    vpred_clipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    err_unclipped = jnp.square(vpreds - returns)
    err_clipped = jnp.square(vpred_clipped - returns)
    err = jnp.maximum(err_unclipped, err_clipped)
    vf_loss = 0.5 * agg_loss(err, m, loss_agg_mode, loss_scale_factor)
    vf_clipfrac = masked_mean((err_clipped > err_unclipped).astype(m.dtype), m)
    return vf_loss, vf_clipfrac


def pairwise_loss(
    chosen: Array,
    rejected: Array,
    *,
    chosen_sign: Array | None = None,
    rejected_sign: Array | None = None,
    sign_coef: float = 0.0,
    center_coef: float = 0.0,
) -> tuple[Array, Array]:
    """The Bradley–Terry loss of a scalar-head model on preference pairs, each [B].

    loss = mean over pairs of -log sigmoid(chosen - rejected)
           + sign_coef * mean of -log sigmoid(sign * score) over both responses
           + center_coef * mean of score^2 over both responses.

    The sign term is Safe-RLHF's cost-model classifier: sign +1 marks a response that is
    costly (unsafe), -1 one that is not, so that a score above 0 means "costly" and a cost
    threshold has a meaning. The centering term (as TRL's center_rewards_coefficient) pins the
    scores' otherwise arbitrary offset near 0.

    Returns (loss, accuracy): accuracy is the share of pairs with chosen > rejected strictly
    (a tie counts as wrong).
    """
    chosen = jnp.asarray(chosen, jnp.float32)
    rejected = jnp.asarray(rejected, jnp.float32)
    loss = jnp.mean(-jax.nn.log_sigmoid(chosen - rejected))
    if sign_coef:
        if chosen_sign is None or rejected_sign is None:
            raise ValueError("pairwise_loss with sign_coef needs chosen_sign and rejected_sign")
        sign = jnp.mean(-jax.nn.log_sigmoid(jnp.asarray(chosen_sign, jnp.float32) * chosen)
                        - jax.nn.log_sigmoid(jnp.asarray(rejected_sign, jnp.float32) * rejected))
        loss = loss + sign_coef * sign / 2
    if center_coef:
        loss = loss + center_coef * jnp.mean(chosen**2 + rejected**2) / 2
    accuracy = jnp.mean((chosen > rejected).astype(jnp.float32))
    return loss, accuracy


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
    m = mask_like(response_mask, token_level_scores)
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
    kind = "fixed"

    def update(self, current_kl: float, n_steps: int) -> FixedKLController:
        """Returns self: the coefficient never changes."""
        return self


@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., 2019) steering the measured KL to ``target_kl``."""

    value: float
    target_kl: float
    horizon: float
    kind = "adaptive"

    def __post_init__(self):
        if not self.horizon > 0:
            raise ValueError(f"adaptive kl_ctrl needs horizon > 0, got {self.horizon}")
        if not self.target_kl > 0:
            raise ValueError(f"adaptive kl_ctrl needs target_kl > 0, got {self.target_kl}")

    def update(self, current_kl: float, n_steps: int) -> AdaptiveKLController:
        """Returns a controller whose value is scaled by 1 + clip(kl/target - 1, +-0.2) * n/horizon.

        ``current_kl`` may be a device scalar; converting it here is the step's one deliberate
        host fetch for the controller.
        """
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        mult = 1.0 + error * n_steps / self.horizon
        return dataclasses.replace(self, value=self.value * mult)


KLController = FixedKLController | AdaptiveKLController
KL_CONTROLLERS: dict[str, type] = {c.kind: c for c in (FixedKLController, AdaptiveKLController)}


def get_kl_controller(
    kl_ctrl_type: str = "fixed",
    kl_coef: float = 0.001,
    target_kl: float = 0.1,
    horizon: float = 10000,
) -> KLController:
    """Returns the initial KL controller state for ``kl_ctrl_type`` "fixed" or "adaptive"."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(value=kl_coef)
    if kl_ctrl_type == "adaptive":
        return AdaptiveKLController(value=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(
        f"unknown kl_ctrl type '{kl_ctrl_type}'; known: {', '.join(sorted(KL_CONTROLLERS))}"
    )


def kl_controller_state(ctrl: KLController) -> dict:
    """The controller as plain JSON data (`kl_controller_from_state` reads it back)."""
    return {"type": ctrl.kind, **dataclasses.asdict(ctrl)}


def kl_controller_from_state(state: dict) -> KLController:
    """The controller saved by `kl_controller_state`."""
    fields = dict(state)
    kind = fields.pop("type")
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"unknown kl_ctrl type {kind!r} in saved state; known: "
                         f"{', '.join(sorted(KL_CONTROLLERS))}")
    return KL_CONTROLLERS[kind](**fields)


# --------------------------------------------------------------------------------------------
# Safe-RLHF's Lagrange multiplier (host-side, immutable, checkpointable as a plain dict)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LagrangeMultiplier:
    """The multiplier lambda = exp(log_lambda) of Safe-RLHF's constraint E[cost] <= threshold.

    `update` takes one gradient-ascent step on lambda * (mean_cost - threshold) with respect
    to log_lambda (as Safe-RLHF does): lambda grows while the batch's mean episode cost is above
    the threshold and shrinks below it, multiplicatively, so it never turns negative. It is
    capped at ``max_lambda``.
    """

    log_lambda: float
    lr: float
    threshold: float
    max_lambda: float = 100.0
    kind = "lagrange"

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"the Lagrange multiplier needs lambda_lr > 0, got {self.lr}")
        if not self.max_lambda > 0:
            raise ValueError(f"the Lagrange multiplier needs max_lambda > 0, got "
                             f"{self.max_lambda}")

    @classmethod
    def create(cls, init: float, lr: float, threshold: float,
               max_lambda: float = 100.0) -> LagrangeMultiplier:
        """A multiplier starting at lambda = init (> 0)."""
        if not init > 0:
            raise ValueError(f"the Lagrange multiplier's initial lambda must be > 0, got {init}")
        return cls(math.log(init), lr, threshold, max_lambda)

    @property
    def value(self) -> float:
        return math.exp(self.log_lambda)

    def update(self, mean_cost: float) -> LagrangeMultiplier:
        """The multiplier after one step on the batch's mean episode cost (a host float)."""
        step = self.lr * self.value * (float(mean_cost) - self.threshold)
        log_lambda = min(self.log_lambda + step, math.log(self.max_lambda))
        return dataclasses.replace(self, log_lambda=log_lambda)

    def state(self) -> dict:
        """Plain JSON data for the checkpoint (`from_state` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> LagrangeMultiplier:
        return cls(**state)
