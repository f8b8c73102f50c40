"""Shared RL numerics: the name registries, masked statistics, log-prob/entropy from logits
and loss aggregation.

Everything here is a pure function of arrays: jit-able, no hidden state and no host transfers.
Token-level tensors are ``[B, T]`` (batch, response length) and come with a ``response_mask``
``[B, T]`` (bool or float, 1 marks a response token that counts); sequence-level tensors are
``[B]``. Names, defaults and semantics follow the verl convention so that a verl recipe carries
over unchanged (``adv_estimator``, ``loss_agg_mode``, ``kl_penalty``, ``clip_ratio_c``, ...).

Estimators (`hfjax.numerics.advantages`), policy losses and KL penalties
(`hfjax.numerics.losses`) and loss aggregations (here) are registered by name; a driver looks
them up with ``ADV_ESTIMATORS.get(config.adv_estimator)`` and so on. Importing
`hfjax.numerics` registers all of them.
"""

from __future__ import annotations

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
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, *names: str, **info: Any) -> Callable[[F], F]:
        """Returns a decorator that registers a function under ``names`` (first name + aliases),
        with keyword facts about it (e.g. ``needs=("values",)``) that `info` returns."""
        if not names:
            raise ValueError(f"register() for {self.kind} needs at least one name")

        def decorator(fn: F) -> F:
            for name in names:
                if name in self._fns:
                    raise ValueError(f"{self.kind} '{name}' is already registered")
                self._fns[name] = fn
                self._info[name] = dict(info)
            return fn

        return decorator

    def info(self, name: str) -> dict[str, Any]:
        """The keyword facts registered with ``name`` (ValueError for an unknown name)."""
        self.get(name)
        return self._info[name]

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


def mask_like(mask: Array, values: Array) -> Array:
    return jnp.asarray(mask).astype(jnp.result_type(values, jnp.float32))


def safe_div(num: Array, den: Array) -> Array:
    # 0 (not nan) for an empty mask: fully padded rows are normal after batch padding.
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), 0)


def masked_sum(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Returns the sum of ``values`` where ``mask`` is set, over ``axis`` (all axes if None)."""
    return jnp.sum(values * mask_like(mask, values), axis=axis)


def masked_mean(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Returns the mean of ``values`` over the masked entries along ``axis``; 0 if none are set."""
    m = mask_like(mask, values)
    return safe_div(jnp.sum(values * m, axis=axis), jnp.sum(m, axis=axis))


def masked_var(values: Array, mask: Array, unbiased: bool = True) -> Array:
    """Returns the variance of the masked entries (all axes).

    With ``unbiased`` the Bessel factor n/(n-1) is applied; a single masked entry gives 0 rather
    than an error, since a jitted program cannot raise on data.
    """
    m = mask_like(mask, values)
    mean = masked_mean(values, m)
    var = masked_mean(jnp.square(values - mean), m)
    if unbiased:
        n = jnp.sum(m)
        var = var * safe_div(n, n - 1)
    return var


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True) -> Array:
    """Returns ``values`` normalised to zero mean and unit (unbiased) variance over the mask.

    With ``shift_mean=False`` the mean is added back, so only the scale changes.
    """
    m = mask_like(mask, values)
    mean = masked_mean(values, m)
    whitened = (values - mean) * jax.lax.rsqrt(masked_var(values, m) + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def logprobs_and_entropy(logits: Array, labels: Array) -> tuple[Array, Array]:
    """(log softmax(logits)[..., label], entropy of softmax(logits)), both float32 of shape
    ``labels.shape``, from one exponential of the logits.

    With x the logits shifted by their (constant) maximum, e = exp(x) and Z = sum e:
    log p(label) = x[label] - log Z and the entropy is log Z - sum(e x) / Z, so one pass over
    the vocabulary gives both (for a policy's vocabulary, the exponential is the costly part:
    on a CPU a [8, 256, 49152] batch takes ~0.2 s per pass). The shift keeps precision when
    logits are large (x[label] and log Z would otherwise both be ~max and cancel in float32);
    -inf logits (masked vocabulary entries) give e = 0 and add nothing.
    """
    x = logits.astype(jnp.float32)
    x = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    e = jnp.exp(x)
    z = jnp.sum(e, axis=-1)
    log_z = jnp.log(z)
    picked = jnp.take_along_axis(x, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    # 0 * -inf would be nan where a logit is -inf: x is read as 0 where e is 0.
    ex = jnp.sum(e * jnp.where(e > 0, x, 0.0), axis=-1)
    return picked - log_z, log_z - ex / z


def entropy_from_logits(logits: Array) -> Array:
    """Returns the entropy of softmax(logits) over the last axis, in float32 (shape ``[...]``);
    `logprobs_and_entropy`'s second half."""
    return logprobs_and_entropy(logits, jnp.zeros(logits.shape[:-1], jnp.int32))[1]


def logprobs_from_logits(logits: Array, labels: Array) -> Array:
    """Returns log softmax(logits)[..., label] in float32, shape ``labels.shape``;
    `logprobs_and_entropy`'s first half (the entropy's sum is left out of the program)."""
    return logprobs_and_entropy(logits, labels)[0]


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
    Sequence means skip rows with no masked tokens. A caller whose batches are trimmed to their
    longest response passes the configured response length as ``loss_scale_factor``, so the
    Dr.GRPO divisor stays the same from batch to batch.

    Returns the scalar loss.
    """
    fn = LOSS_AGG_MODES.get(loss_agg_mode)
    return fn(loss_mat, mask_like(loss_mask, loss_mat), loss_scale_factor)
