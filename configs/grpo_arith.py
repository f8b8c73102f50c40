"""GRPO on the embedded arithmetic task: 8 samples per prompt, group-normalised outcome
advantages, a KL loss against the warm-started reference, no critic."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.algorithm = "grpo"
    c.data.train_batch_size = 32
    c.rollout.n = 8
    c.actor.ppo_mini_batch_size = 16  # prompts: 16 x 8 = 128 sequences per update
    c.actor.ppo_micro_batch_size = 128
    c.actor.use_kl_loss = True
    c.actor.kl_loss_coef = 0.001
    c.actor.kl_loss_type = "low_var_kl"
    c.algo.adv_estimator = "grpo"
    c.algo.use_kl_in_reward = False
    c.trainer.out_dir = "runs/grpo_arith"
    return c
