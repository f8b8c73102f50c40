"""ReMax on the embedded arithmetic task: one sample per prompt, the reward of the greedy
response to the same prompt as its baseline, KL to the warm-started reference in the reward,
no critic."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.algorithm = "remax"
    c.algo.adv_estimator = "remax"
    c.algo.use_kl_in_reward = True
    c.trainer.out_dir = "runs/remax_arith"
    return c
