"""RLOO on the embedded arithmetic task: 8 samples per prompt, each one's baseline the mean
score of the other seven, KL to the warm-started reference in the reward, no critic."""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.algorithm = "rloo"
    c.algo.adv_estimator = "rloo"
    c.actor.use_kl_loss = False
    c.algo.use_kl_in_reward = True
    c.trainer.out_dir = "runs/rloo_arith"
    return c
