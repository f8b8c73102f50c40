"""PPO with a GAE critic, as one dataflow step over worker groups (the paper's Figure 6)."""

from hfjax.algorithms.dataflow import Workers, compute_advantage, sample
from hfjax.algorithms.registry import register_algorithm


@register_algorithm("ppo", roles=("actor", "rollout", "ref", "critic", "reward"))
def ppo_step(w: Workers, batch, cfg) -> dict:
    batch = sample(w, batch, cfg)
    values = w.run("values", lambda b: w.critic.compute_values(b).to(w.actor.mesh), batch)
    batch = batch.union(values)
    batch = batch.union(w.run("reward", w.reward.compute_reward, batch))
    batch, metrics = w.run(
        "adv", compute_advantage, batch, cfg.algo, cfg.rollout.n, w.kl_ctrl.value
    )
    metrics |= w.run("update_critic", w.critic.update_critic, batch)
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics
