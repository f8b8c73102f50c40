"""REINFORCE++-baseline on the embedded arithmetic task: 8 samples per prompt, each score minus
its prompt's mean, whitened over the batch; KL to the warm-started reference in the reward."""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.algorithm = "reinforce_plus_plus_baseline"
    c.algo.adv_estimator = "reinforce_plus_plus_baseline"
    c.actor.use_kl_loss = False
    c.algo.use_kl_in_reward = True
    c.trainer.out_dir = "runs/reinforce_plus_plus_baseline_arith"
    return c
