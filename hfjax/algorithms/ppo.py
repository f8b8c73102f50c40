"""PPO with a GAE critic, as one dataflow step over worker groups (the paper's Figure 6).

The reward stage scores with the rule reward, a learned reward model (`reward_model.path`:
classic RLHF, configs/ppo_rm_arith.py), or both, weighted per data_source."""

from hfjax.algorithms.dataflow import compute_advantage, reward, sample
from hfjax.algorithms.registry import register_algorithm
from hfjax.algorithms.spec import StepSpec
from hfjax.controller.batch import Batch
from hfjax.workers.groups import WorkerGroups


@register_algorithm("ppo", roles=("actor", "ref", "critic", "reward"),
                    provides=("values",))
def ppo_step(w: WorkerGroups, batch: Batch, spec: StepSpec) -> tuple[Batch, dict]:
    batch = sample(w, batch, spec)
    batch = batch.union(w.run("values", w.critic.compute_values, batch))
    batch = reward(w, batch, spec)
    batch, metrics = w.run("adv", compute_advantage, batch, spec, w.kl_ctrl.value)
    metrics |= w.run("update_critic", w.critic.update_critic, batch)
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics
