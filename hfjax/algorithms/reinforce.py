"""The REINFORCE family, critic-free like GRPO but with the KL folded into the reward:

- RLOO: each sample's baseline is the mean score of the other samples of its prompt;
- REINFORCE++: the discounted return-to-go whitened over the batch (one sample per prompt is
  enough);
- REINFORCE++-baseline: the score minus its prompt's mean, whitened over the batch.
"""

from hfjax.algorithms.dataflow import compute_advantage, reward, sample
from hfjax.algorithms.registry import register_algorithm, requires
from hfjax.controller.batch import Batch
from hfjax.workers.groups import WorkerGroups

ROLES = ("actor", "rollout", "ref", "reward")


@register_algorithm("rloo", roles=ROLES, check=requires("rloo", algo__adv_estimator="rloo"))
@register_algorithm("reinforce_plus_plus", roles=ROLES, check=requires(
    "reinforce_plus_plus", algo__adv_estimator="reinforce_plus_plus"))
@register_algorithm("reinforce_plus_plus_baseline", roles=ROLES, check=requires(
    "reinforce_plus_plus_baseline", algo__adv_estimator="reinforce_plus_plus_baseline"))
def reinforce_step(w: WorkerGroups, batch: Batch, cfg) -> tuple[Batch, dict]:
    batch = sample(w, batch, cfg)
    batch = reward(w, batch, cfg)
    batch, metrics = w.run("adv", compute_advantage, batch, cfg, w.kl_ctrl.value)
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics
