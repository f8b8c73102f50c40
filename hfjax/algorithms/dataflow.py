"""What the algorithm drivers share: the worker-group handles, stage timing, and the
advantage stage (KL-in-reward plus a registered estimator), jitted once per shape."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from hfjax.algorithms import core, losses
from hfjax.controller.batch import Batch


@dataclasses.dataclass
class Workers:
    """The worker groups of one run; roles an algorithm does not use are None."""

    actor: Any
    ref: Any = None
    critic: Any = None
    reward: Any = None
    rm: Any = None
    kl_ctrl: Any = None
    sync_timing: bool = True
    timing: dict[str, float] = dataclasses.field(default_factory=dict)

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs one stage, `fn(*args)`, and returns its result, timed as `timing_s/<name>`.

        With sync_timing the time waits for the result's arrays, so it is the stage's own;
        without it, only dispatch is timed and worker groups on disjoint pools can overlap.
        """
        t0 = time.perf_counter()
        out = fn(*args)
        if self.sync_timing:
            jax.block_until_ready(
                jax.tree.map(lambda x: x.arrays if isinstance(x, Batch) else x, out,
                             is_leaf=lambda x: isinstance(x, Batch))
            )
        self.timing[f"timing_s/{name}"] = time.perf_counter() - t0
        return out


def sample(w: Workers, batch: Batch, cfg) -> Batch:
    """The stages every algorithm starts with: generate the responses, score them under the
    pre-update policy when the update needs it, and under the reference policy when there is
    one. Returns the batch with responses, old_log_probs and ref_log_prob as applicable."""
    batch = w.run("gen", w.actor.generate, batch)
    if needs_old_log_prob(w, batch, cfg):
        batch = batch.union(w.run("old_log_prob", w.actor.compute_log_prob, batch))
    if w.ref is not None:
        ref = w.run("ref", lambda b: w.ref.compute_ref_log_prob(b).to(w.actor.mesh), batch)
        batch = batch.union(ref)
    return batch


@functools.partial(jax.jit, static_argnames=("estimator", "kl_penalty", "use_kl", "n", "opts"))
def _advantage(arrays, kl_coef, *, estimator, kl_penalty, use_kl, n, opts):
    mask = arrays["response_mask"].astype(jnp.float32)
    scores = arrays["token_level_scores"]
    metrics = {}
    if use_kl:
        rewards, kl = losses.apply_kl_penalty(
            scores, arrays["old_log_probs"], arrays["ref_log_prob"], mask, kl_coef, kl_penalty
        )
        metrics["actor/reward_kl_penalty"] = kl
    else:
        rewards = scores
    b = scores.shape[0]
    adv, ret = core.ADV_ESTIMATORS.get(estimator)(
        token_level_rewards=rewards,
        response_mask=mask,
        values=arrays.get("values"),
        index=jnp.arange(b) // n,
        num_groups=b // n,
        **dict(opts),
    )
    return {"token_level_rewards": rewards, "advantages": adv, "returns": ret}, metrics


def needs_old_log_prob(w: Workers, batch: Batch, cfg) -> bool:
    """Whether a step must score its samples under the pre-update policy (`old_log_probs`).

    Not when the actor takes a single update on the batch and no KL penalty goes into the
    reward: the samples' policy is then the current one, and the actor's loss uses its own
    detached log-probs (as TRL and Tunix do), saving a forward pass over the batch.
    """
    return bool(cfg.algo.use_kl_in_reward) or not w.actor.single_update(len(batch))


def compute_advantage(batch: Batch, algo_cfg, n: int, kl_coef: float) -> tuple[Batch, dict]:
    """Adds token_level_rewards, advantages and returns; rows come in groups of n samples."""
    use_kl = bool(algo_cfg.use_kl_in_reward)
    keys = ["response_mask", "token_level_scores"] + (["old_log_probs", "ref_log_prob"]
                                                      if use_kl else [])
    if "values" in batch:
        keys.append("values")
    opts = (("gamma", float(algo_cfg.gamma)), ("lam", float(algo_cfg.lam)))
    if algo_cfg.adv_estimator == "grpo":
        opts += (("norm_adv_by_std_in_grpo", bool(algo_cfg.norm_adv_by_std_in_grpo)),)
    # The KL coefficient is host-side controller state (the adaptive controller updates it from
    # the fetched metrics): one deliberate scalar upload per step.
    with jax.transfer_guard("allow"):
        coef = jnp.float32(kl_coef if use_kl else 0.0)
    out, metrics = _advantage(
        {k: batch[k] for k in keys},
        coef,
        estimator=algo_cfg.adv_estimator,
        kl_penalty=algo_cfg.kl_penalty,
        use_kl=use_kl,
        n=n,
        opts=opts,
    )
    return batch.union(Batch(out)), metrics
