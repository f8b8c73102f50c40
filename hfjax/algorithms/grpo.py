"""GRPO: n samples per prompt, group-normalised outcome advantages, a KL loss, no critic."""

from hfjax.algorithms.dataflow import compute_advantage, sample
from hfjax.algorithms.registry import register_algorithm
from hfjax.controller.batch import Batch
from hfjax.workers.groups import WorkerGroups


@register_algorithm("grpo", roles=("actor", "rollout", "ref", "reward"))
def grpo_step(w: WorkerGroups, batch: Batch, cfg) -> tuple[Batch, dict]:
    batch = sample(w, batch, cfg)
    batch = batch.union(w.run("reward", w.reward.compute_reward, batch))
    batch, metrics = w.run("adv", compute_advantage, batch, cfg, w.kl_ctrl.value)
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics
