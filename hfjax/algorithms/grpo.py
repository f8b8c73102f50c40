"""GRPO: n samples per prompt, group-normalised outcome advantages, a KL loss, no critic."""

from hfjax.algorithms.dataflow import Workers, compute_advantage, sample
from hfjax.algorithms.registry import register_algorithm


@register_algorithm("grpo", roles=("actor", "rollout", "ref", "reward"))
def grpo_step(w: Workers, batch, cfg) -> dict:
    batch = sample(w, batch, cfg)
    batch = batch.union(w.run("reward", w.reward.compute_reward, batch))
    batch, metrics = w.run(
        "adv", compute_advantage, batch, cfg.algo, cfg.rollout.n, w.kl_ctrl.value
    )
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics
