"""ReMax: REINFORCE with the reward of the greedy response to the same prompt as the baseline;
no critic. One extra generate call per step (greedy) and one extra reward call replace the
critic's forward and update passes."""

import functools

import jax
import jax.numpy as jnp

from hfjax.algorithms.dataflow import compute_advantage, reward, sample
from hfjax.algorithms.registry import register_algorithm, requires
from hfjax.algorithms.spec import StepSpec
from hfjax.controller.batch import Batch
from hfjax.workers.groups import WorkerGroups


@register_algorithm("remax", roles=("actor", "ref", "reward"),
                    provides=("reward_baselines",),
                    check=requires("remax", algo__adv_estimator="remax"))
def remax_step(w: WorkerGroups, batch: Batch, spec: StepSpec) -> tuple[Batch, dict]:
    greedy = w.run("gen_greedy", functools.partial(w.actor.generate, greedy=True, n=1), batch)
    greedy = reward(w, greedy, spec, name="reward_greedy")
    batch = sample(w, batch, spec)
    batch = reward(w, batch, spec)
    batch = batch.union(Batch({"reward_baselines": baselines(
        greedy["token_level_scores"], spec.rollout.n)}))
    batch, metrics = w.run("adv", compute_advantage, batch, spec, w.kl_ctrl.value)
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics


@functools.partial(jax.jit, static_argnums=1)
def baselines(greedy_scores: jax.Array, n: int) -> jax.Array:
    """Each prompt's greedy score [B], repeated for its n samples (rows b*n .. b*n+n-1)."""
    return jnp.repeat(jnp.sum(greedy_scores, axis=1), n, total_repeat_length=
                      greedy_scores.shape[0] * n)
