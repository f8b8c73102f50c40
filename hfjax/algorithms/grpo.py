"""GRPO: n samples per prompt, group-normalised outcome advantages, a KL loss, no critic."""

from hfjax.algorithms.dataflow import Workers, compute_advantage, needs_old_log_prob
from hfjax.algorithms.registry import register_algorithm


@register_algorithm("grpo", roles=("actor", "rollout", "ref", "reward"))
def grpo_step(w: Workers, batch, cfg) -> dict:
    with w.stage("gen") as out:
        batch = w.actor.generate(batch)
        out.append(batch)
    if needs_old_log_prob(w, batch, cfg):
        with w.stage("old_log_prob") as out:
            batch = batch.union(w.actor.compute_log_prob(batch))
            out.append(batch)
    if w.ref is not None:
        with w.stage("ref") as out:
            batch = batch.union(w.ref.compute_ref_log_prob(batch).to(w.actor.mesh))
            out.append(batch)
    with w.stage("reward") as out:
        batch = batch.union(w.reward.compute_reward(batch))
        out.append(batch)
    with w.stage("adv") as out:
        batch, metrics = compute_advantage(batch, cfg.algo, cfg.rollout.n, w.kl_ctrl.value)
        out.append(batch)
    with w.stage("update_actor") as out:
        metrics |= w.actor.update_actor(batch)
        out.append(metrics)
    return batch, metrics
