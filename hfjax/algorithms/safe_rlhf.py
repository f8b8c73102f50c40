"""Safe-RLHF (the paper's Figure 6, PPO plus five calls): a reward model and a cost model score
each response, a reward critic and a cost critic value it, and the actor follows
(A_reward - lambda * A_cost) / (1 + lambda), where the Lagrange multiplier lambda grows while
the batch's mean cost is above `algo.safe_rlhf.cost_threshold` and shrinks below it
(`hfjax.numerics.losses.LagrangeMultiplier`, updated by the trainer once per step from the
fetched metrics). docs/algorithms.md builds this algorithm step by step.
"""

from hfjax.algorithms.dataflow import compute_advantage, cost, reward, sample
from hfjax.algorithms.registry import all_of, register_algorithm, requires
from hfjax.algorithms.spec import StepSpec
from hfjax.controller.batch import Batch
from hfjax.workers.groups import WorkerGroups


def _check(cfg) -> None:
    for role, what in (("reward_model", "reward"), ("cost_model", "cost")):
        section = cfg.get(role)
        if section is None or not section.path:
            raise ValueError(
                f"algorithm 'safe_rlhf' needs a {what} model: set --config.{role}.path to a "
                f"{what} model directory (python -m launch.train_rm writes one; "
                "scripts/safe_rlhf_arith.sh trains both)")


@register_algorithm(
    "safe_rlhf",
    roles=("actor", "ref", "critic", "cost_critic", "reward", "reward_model",
           "cost_model"),
    provides=("values", "cost_values", "token_level_costs"),
    check=all_of(_check, requires("safe_rlhf", algo__adv_estimator="safe_rlhf")),
)
def safe_rlhf_step(w: WorkerGroups, batch: Batch, spec: StepSpec) -> tuple[Batch, dict]:
    batch = sample(w, batch, spec)
    batch = batch.union(w.run("values", w.critic.compute_values, batch))
    batch = batch.union(w.run("cost_values", w.cost_critic.compute_values, batch))
    batch = reward(w, batch, spec)
    batch = cost(w, batch)
    batch, metrics = w.run("adv", compute_advantage, batch, spec, w.kl_ctrl.value, w.lagrange)
    metrics |= w.run("update_critic", w.critic.update_critic, batch)
    metrics |= w.run("update_cost_critic", w.cost_critic.update_critic, batch)
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics
