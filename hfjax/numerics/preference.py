"""Offline preference losses (DPO and its relatives) over sequence log-probs of preference pairs.

Each loss is a pure function of `PreferenceInputs` (per pair [B]: the policy's and the
reference's summed response log-probs of the chosen and the rejected side, and each side's
response token count) and returns (losses [B], chosen rewards [B], rejected rewards [B]); the
rewards are the implicit ones the metrics report (TRL's `rewards/chosen`, `rewards/rejected`).
They are registered by name in `PREFERENCE_LOSSES`, with `reference=` saying whether the loss
reads the reference's log-probs (SimPO does not: its runs build no reference).

- `sigmoid` (DPO): -log sigma(beta * h), h = (pi_c - ref_c) - (pi_r - ref_r), with label
  smoothing eps (conservative DPO): (1 - eps) of that plus eps of -log sigma(-beta * h);
- `ipo`: (h' - 1 / (2 beta))^2, where h' is h over per-token means (IPO's log-probs are
  length-averaged, as TRL averages them); its rewards are DPO's, beta times the summed
  log-ratios (TRL's `rewards/*` for IPO);
- `simpo`: reference-free and length-normalised: -log sigma(beta * (pi_c / n_c - pi_r / n_r)
  - gamma), with the same label smoothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hfjax.numerics.core import Registry

Array = jax.Array

PREFERENCE_LOSSES: Registry = Registry("preference loss")


@dataclasses.dataclass(frozen=True)
class PreferenceInputs:
    """Per pair [B]: summed response log-probs of the chosen and rejected sides under the
    policy and the reference (the reference's are ignored by reference-free losses), and each
    side's response token count; the loss's settings."""

    chosen_logps: Array
    rejected_logps: Array
    ref_chosen_logps: Array
    ref_rejected_logps: Array
    chosen_tokens: Array
    rejected_tokens: Array
    beta: float
    label_smoothing: float = 0.0
    gamma: float = 0.0  # SimPO's target margin


def _smoothed(logits: Array, eps: float) -> Array:
    return -(1.0 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)


@PREFERENCE_LOSSES.register("sigmoid", reference=True)
def dpo_loss(x: PreferenceInputs) -> tuple[Array, Array, Array]:
    """DPO's logistic loss on the policy-to-reference log-ratio margin."""
    chosen = x.chosen_logps - x.ref_chosen_logps
    rejected = x.rejected_logps - x.ref_rejected_logps
    return (_smoothed(x.beta * (chosen - rejected), x.label_smoothing),
            x.beta * chosen, x.beta * rejected)


@PREFERENCE_LOSSES.register("ipo", reference=True)
def ipo_loss(x: PreferenceInputs) -> tuple[Array, Array, Array]:
    """IPO's squared loss pulling the per-token log-ratio margin to 1 / (2 beta). Its rewards
    are DPO's (summed log-ratios), as TRL reports them for IPO too."""
    chosen = x.chosen_logps - x.ref_chosen_logps
    rejected = x.rejected_logps - x.ref_rejected_logps
    margin = (chosen / jnp.maximum(x.chosen_tokens, 1.0)
              - rejected / jnp.maximum(x.rejected_tokens, 1.0))
    return (margin - 1.0 / (2.0 * x.beta)) ** 2, x.beta * chosen, x.beta * rejected


@PREFERENCE_LOSSES.register("simpo", reference=False)
def simpo_loss(x: PreferenceInputs) -> tuple[Array, Array, Array]:
    """SimPO: the logistic loss on length-normalised policy log-probs, less a target margin."""
    chosen = x.beta * x.chosen_logps / jnp.maximum(x.chosen_tokens, 1.0)
    rejected = x.beta * x.rejected_logps / jnp.maximum(x.rejected_tokens, 1.0)
    return _smoothed(chosen - rejected - x.gamma, x.label_smoothing), chosen, rejected


def needs_reference(loss_type: str) -> bool:
    """Whether the registered loss `loss_type` reads the reference's log-probs."""
    return bool(PREFERENCE_LOSSES.info(loss_type)["reference"])
