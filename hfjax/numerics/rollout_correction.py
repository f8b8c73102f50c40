"""Rollout correction: importance weights and rejection masks between the policy that sampled a
batch (the rollout's per-token log-probs) and the trainer's old policy (decoupled PPO), with
verl's setting names (`algo.rollout_correction`) and metric names (`rollout_corr/...`).

The sampler and the trainer compute the same policy's log-probs with different programs
(decode steps against a cache, bf16, a stale copy of the weights in an asynchronous run), so
pi_rollout and pi_old differ. PPO's ratio pi_theta / pi_old corrects only the drift from pi_old
to the policy being trained; the samples were drawn from pi_rollout, and
w = pi_old / pi_rollout corrects the rest:

- ``rollout_is`` ("token" or "sequence"): truncated importance weights, min(w, threshold),
  per token, or one per sequence (the product of its tokens' ratios) on each of its tokens.
  Every policy loss multiplies its per-token loss by them (`PolicyLossInputs.rollout_is_weights`).
- ``rollout_rs`` ("token", "sequence" or "geometric"): rejection. A token (or a whole sequence,
  by the product or the geometric mean of its ratios) whose ratio lies outside
  [lower, upper] leaves the update's loss mask: it adds nothing, nor to the denominators.
- ``rollout_token_veto_threshold``: a sequence with any token whose (unbounded) ratio is below
  it is rejected whole.

``rollout_is`` defaults to "auto": token-level truncated weights when the run is asynchronous
(`async_rollout.max_staleness` >= 1, so pi_rollout lags pi_old by up to K updates) and not in
bypass mode, off otherwise; "none" (or "") turns it off (`level_in_force`).

Rejected tokens leave everything downstream of the correction, as in verl, where the rejection
rewrites the response mask before the advantages: the advantage estimator (GAE's recursion
skips them as it skips tool tokens, whitening is over the kept tokens), the critic's loss and
the policy loss. In bypass mode (pi_old is pi_rollout) the ratio to correct is
pi_theta / pi_rollout, which changes while the actor updates, so rejection is decided inside
the policy loss on each micro-batch (`bypass_keep`) and removes tokens from that loss only.

Ratios are formed in log space and bounded to [-20, 20] before any exponential (the safety
bound), so one far-off token cannot overflow a weight. Everything is zero outside the response
mask. These are pure functions of arrays, jitted by their caller.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from hfjax.numerics.core import LOG_RATIO_CLAMP, Array, mask_like, masked_mean, safe_div

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
AUTO, NONE = "auto", "none"


def level_in_force(rollout_is: str, max_staleness: int, bypass_mode: bool) -> str:
    """The importance-weight level a run applies ("" when off): "auto" is "token" when the run
    is asynchronous (K >= 1) and not in bypass mode (where PPO's ratio already is the
    importance ratio to the sampler), else off; "none" is off; a level is itself."""
    if rollout_is == AUTO:
        return "token" if max_staleness >= 1 and not bypass_mode else ""
    return "" if rollout_is == NONE else rollout_is


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """The settings, resolved: levels are "" when off, thresholds are the values in force
    (``rs_upper`` defaults to ``is_threshold``, ``rs_lower`` to 1 / ``rs_upper``; a veto of 0
    is off)."""

    rollout_is: str = ""
    is_threshold: float = 2.0
    rollout_rs: str = ""
    rs_upper: float = 2.0
    rs_lower: float = 0.5
    veto_threshold: float = 0.0

    @property
    def active(self) -> bool:
        """Whether anything changes the loss (and the step needs pi_old and pi_rollout)."""
        return bool(self.rollout_is or self.rollout_rs or self.veto_threshold)


def resolve(rollout_is: str, rollout_is_threshold: float, rollout_rs: str,
            rollout_rs_threshold: float, rollout_rs_threshold_lower: float,
            rollout_token_veto_threshold: float) -> RolloutCorrection:
    """The settings in force, from the config's values (0 thresholds meaning "the default",
    as verl's null): ValueError naming the key for a level or threshold that cannot work."""
    if rollout_is == AUTO:
        raise ValueError("algo.rollout_correction.rollout_is='auto' depends on the run's "
                         "async_rollout.max_staleness: resolve it with level_in_force first "
                         "(StepSpec.of does)")
    rollout_is = "" if rollout_is == NONE else rollout_is
    rollout_rs = "" if rollout_rs == NONE else rollout_rs
    if rollout_is not in ("", *IS_LEVELS):
        raise ValueError(f"algo.rollout_correction.rollout_is={rollout_is!r}; use one of "
                         f"{', '.join(IS_LEVELS)}, or '' for none")
    if rollout_rs not in ("", *RS_LEVELS):
        raise ValueError(f"algo.rollout_correction.rollout_rs={rollout_rs!r}; use one of "
                         f"{', '.join(RS_LEVELS)}, or '' for none")
    upper = rollout_rs_threshold or rollout_is_threshold
    lower = rollout_rs_threshold_lower or 1.0 / upper
    if rollout_rs and not lower < upper:
        raise ValueError(f"algo.rollout_correction: the rejection interval [{lower:g}, "
                         f"{upper:g}] is empty; set rollout_rs_threshold_lower below "
                         "rollout_rs_threshold")
    return RolloutCorrection(rollout_is, float(rollout_is_threshold), rollout_rs, float(upper),
                             float(lower), float(rollout_token_veto_threshold))


def describe(c: RolloutCorrection, bypass_mode: bool) -> str:
    """One line naming the correction in force, for the run's first log lines."""
    parts = []
    if bypass_mode:
        parts.append("bypass mode (the sampler's log-probs are pi_old; PPO clips against them)")
    if c.rollout_is:
        parts.append(f"{c.rollout_is}-level truncated importance weights pi_old / pi_rollout "
                     f"(threshold {c.is_threshold:g})")
    if c.rollout_rs:
        ratio = "pi_theta / pi_rollout in the policy loss" if bypass_mode else "the ratio"
        parts.append(f"{c.rollout_rs}-level rejection outside [{c.rs_lower:g}, {c.rs_upper:g}] "
                     f"of {ratio}")
    if c.veto_threshold:
        parts.append(f"a veto below {c.veto_threshold:g}")
    return "; ".join(parts) if parts else "none"


def _bounded(log_ratio: Array) -> Array:
    return jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def correct(old_log_prob: Array, rollout_log_prob: Array, response_mask: Array,
            c: RolloutCorrection) -> tuple[Array, Array, dict[str, Array]]:
    """Importance weights, rejection mask and metrics for a batch ([B, T] arrays).

    Returns (rollout_is_weights [B, T]: the truncated weights on response tokens, 1 there when
    ``rollout_is`` is off, 0 elsewhere; rollout_rs_mask [B, T]: 1 on the response tokens kept,
    0 on those rejected and outside the response; metrics, device scalars named as verl's):
    - rollout_corr/rollout_is_mean, _max: the ratio pi_old / pi_rollout (at the IS level,
      token by default), bounded but not truncated, over response tokens;
    - rollout_corr/rollout_is_ratio_fraction_high: the share of response tokens whose weight
      the threshold truncated;
    - rollout_corr/rollout_is_eff_sample_size: (mean w)^2 / mean(w^2) of the weights applied,
      over response tokens, in (0, 1];
    - rollout_corr/rollout_rs_masked_fraction, rollout_rs_seq_masked_fraction: the shares of
      response tokens, and of responses with any token, that rejection removed;
      rollout_corr/rollout_is_veto_fraction: the share of responses the veto removed;
    - rollout_corr/kl: mean over response tokens of log pi_rollout - log pi_old (an estimate
      of KL(pi_rollout || pi_old), may be negative); rollout_corr/k3_kl: the non-negative
      estimate mean(w - log w - 1).
    """
    m = mask_like(response_mask, old_log_prob)
    raw = (old_log_prob.astype(jnp.float32) - rollout_log_prob.astype(jnp.float32)) * m
    log_ratio = _bounded(raw)
    n_tok = jnp.sum(m, axis=-1)
    rows = (n_tok > 0).astype(m.dtype)
    seq = _bounded(jnp.sum(raw, axis=-1))  # log of the product of the token ratios
    geo = _bounded(safe_div(jnp.sum(raw, axis=-1), n_tok))  # log of their geometric mean

    level_ratio = log_ratio if c.rollout_is != "sequence" else seq[:, None] * m
    ratio = jnp.exp(level_ratio)
    if c.rollout_is:
        weights = jnp.minimum(ratio, c.is_threshold) * m
        high = (ratio > c.is_threshold).astype(m.dtype)
    else:
        weights = m
        high = jnp.zeros_like(m)

    keep = m
    if c.rollout_rs:
        lo, hi = math.log(c.rs_lower), math.log(c.rs_upper)
        by = {"token": log_ratio, "sequence": seq[:, None], "geometric": geo[:, None]}
        x = by[c.rollout_rs]
        keep = keep * ((x >= lo) & (x <= hi)).astype(m.dtype)
    vetoed = jnp.zeros_like(rows)
    if c.veto_threshold:
        bad = (raw < math.log(c.veto_threshold)) & (m > 0)
        vetoed = jnp.any(bad, axis=-1).astype(m.dtype)
        keep = keep * (1.0 - vetoed)[:, None]

    rejected = m - keep
    w_mean = masked_mean(weights, m)
    metrics = {
        "rollout_corr/rollout_is_mean": masked_mean(ratio, m),
        "rollout_corr/rollout_is_max": jnp.max(jnp.where(m > 0, ratio, 0.0)),
        "rollout_corr/rollout_is_ratio_fraction_high": masked_mean(high, m),
        "rollout_corr/rollout_is_eff_sample_size": safe_div(
            jnp.square(w_mean), masked_mean(jnp.square(weights), m)),
        "rollout_corr/rollout_rs_masked_fraction": masked_mean(rejected, m),
        "rollout_corr/rollout_rs_seq_masked_fraction": masked_mean(
            (jnp.sum(rejected, axis=-1) > 0).astype(m.dtype), rows),
        "rollout_corr/rollout_is_veto_fraction": masked_mean(vetoed, rows),
        "rollout_corr/kl": masked_mean(-raw, m),
        "rollout_corr/k3_kl": masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, m),
    }
    return weights, keep, metrics


def bypass_keep(log_prob: Array, rollout_log_prob: Array, response_mask: Array,
                c: RolloutCorrection) -> Array:
    """Bypass mode's rejection, inside the policy loss: the response tokens [B, T] kept when
    the ratio is pi_theta / pi_rollout (``log_prob``, the policy being updated, taken without
    its gradient). Levels and the veto are `correct`'s; the weights are not applied (with a
    clipped loss the ratio against the sampler already is the importance ratio)."""
    _, keep, _ = correct(log_prob, rollout_log_prob, response_mask,
                         dataclasses.replace(c, rollout_is=""))
    return keep
