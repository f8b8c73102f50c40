"""REINFORCE++ on the embedded arithmetic task: one sample per prompt, the discounted
return-to-go (with the KL to the warm-started reference folded into the reward) whitened over
the batch, no critic."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.algorithm = "reinforce_plus_plus"
    c.algo.adv_estimator = "reinforce_plus_plus"
    c.algo.use_kl_in_reward = True
    c.trainer.out_dir = "runs/reinforce_plus_plus_arith"
    return c
