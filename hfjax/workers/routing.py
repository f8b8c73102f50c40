"""A mixture-of-experts actor's terms: its update's router losses and metrics
(`update_terms`), and routing replay (`actor.router_replay`).

The sampler records every token's top-k expert ids (`GenerateOutput.routing`); `batch_columns`
lays them out as the batch's `routed_experts` [B, P + R, sparse layers, k] (small ints: uint8
up to 256 experts), column for column with `input_ids`, and they travel with the batch. The
actor hands them to its forward passes (`hfjax.models.moe.given_routing`):

- `none`: nothing is replayed; the update compares its own routing with the sampler's;
- `r2`: the old-policy log-prob pass replays the sampler's experts, so its log-probs are the
  sampler's up to numerical noise; the update routes by itself (and compares);
- `r3`: the update replays them too, so the policy ratio's numerator and denominator route
  every token through the same experts.

Either way the update logs `actor/router_mismatch`: the share of response tokens whose
predicting position (the one whose hidden state gives the token's log-prob) has, in some
sparse layer, a top-k set other than the sampler's (with `r3`: other than the replayed one,
given the replayed layers below).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hfjax.engine import shared_prompt
from hfjax.models import moe
from hfjax.models.attention import SharedPrompt
from hfjax.numerics import core

MODES = ("none", "r2", "r3")


def check(mode: str, *, moe: bool, packed: bool, grouped: bool, multi_turn: bool,
          continuous: bool) -> None:
    """Refuses, in one line, a replay setting that cannot run (before anything compiles)."""
    if mode not in MODES:
        raise ValueError(f"actor.router_replay={mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return
    if not moe:
        raise ValueError(f"actor.router_replay={mode} needs a mixture-of-experts model; this "
                         "one is dense (set actor.router_replay=none)")
    for on, what in ((packed, "actor.use_remove_padding=True"),
                     (grouped, "actor.group_by_length=True"),
                     (multi_turn, "rollout.multi_turn.enable=True"),
                     (continuous, "rollout.mode=continuous")):
        if on:
            raise ValueError(f"actor.router_replay={mode} with {what}: that path does not "
                             "carry the recorded routing yet; turn it off or set "
                             "actor.router_replay=none")


def recorded(routing: jax.Array | None, prompt_width: int, response_width: int,
             mode: str) -> dict[str, jax.Array]:
    """The batch's `routed_experts` from a rollout's `GenerateOutput.routing` (`batch_columns`);
    none for a dense model. Raises if replay is on and the rollout path recorded none."""
    if routing is not None:
        return {"routed_experts": batch_columns(routing, prompt_width, response_width)}
    if mode != "none":
        raise ValueError(f"actor.router_replay={mode}: this rollout path recorded no routing; "
                         "set actor.router_replay=none")
    return {}


@functools.partial(jax.jit, static_argnums=(1, 2))
def batch_columns(routing: jax.Array, prompt_width: int, response_width: int) -> jax.Array:
    """The sampler's routing [rows, bucket + R, ...] (its prompts left-padded to its bucket,
    R = `response_width`) as the batch's columns [rows, prompt_width + R, ...] (the batch's
    prompts left-padded to `prompt_width`): prompt columns aligned on the right, padding
    columns 0."""
    bucket = routing.shape[1] - response_width
    prompt, response = routing[:, :bucket], routing[:, bucket:]
    if prompt_width <= bucket:
        prompt = prompt[:, bucket - prompt_width:]
    else:
        pad = [(0, 0), (prompt_width - bucket, 0)] + [(0, 0)] * (routing.ndim - 2)
        prompt = jnp.pad(prompt, pad)
    return jnp.concatenate([prompt, response], axis=1)


def update_terms(stats: moe.RouterStats, spec, mb: dict[str, jax.Array], share: int, weight,
                 totals: dict[str, jax.Array], metrics: dict) -> jax.Array:
    """The router losses a mixture of experts' update adds (`actor.moe_aux_loss_coef`,
    `moe_z_loss_coef`, of an `ActorSpec` `spec`; both averaged over the sparse layers), with
    their metrics, the tokens-per-expert spread (the least and most loaded experts' share of
    the mean load, worst layer) and, for a batch with recorded routing, `actor/router_mismatch`
    written into `metrics` (each weighted by the micro-batch's `weight`, as the other losses'
    metrics)."""
    aux, z = jnp.mean(stats.aux_loss), jnp.mean(stats.z_loss)
    low, high = moe.load_spread(stats.counts)
    metrics["actor/moe_aux_loss"] = jax.lax.stop_gradient(aux) * weight
    metrics["actor/moe_z_loss"] = jax.lax.stop_gradient(z) * weight
    metrics["actor/expert_load_min"] = low * weight
    metrics["actor/expert_load_max"] = high * weight
    if "routed_experts" in mb:
        metrics["actor/router_mismatch"] = mismatch_share(stats.mismatch, mb, share, totals)
    return spec.moe_aux_loss_coef * aux + spec.moe_z_loss_coef * z


def mismatch_share(mismatch: jax.Array, mb: dict[str, jax.Array], share: int,
                   totals: dict[str, jax.Array]) -> jax.Array:
    """`actor/router_mismatch`'s part from a micro-batch: `mismatch` [sparse layers, rows,
    columns] from the update's forward pass (shared-prompt rows of `share` samples when
    `share` > 1), as a share of the mini-batch's response tokens (`totals["tokens"]`)."""
    m = jnp.any(mismatch, axis=0)
    r = mb["responses"].shape[1]
    p = mb["input_ids"].shape[1] - r
    if share > 1:
        pred = shared_prompt.predicting(m[..., None], SharedPrompt(p, share))[..., 0]
    else:
        pred = m[:, p - 1: p + r - 1]
    return core.masked_sum(pred.astype(jnp.float32), mb["response_mask"]) / totals["tokens"]
