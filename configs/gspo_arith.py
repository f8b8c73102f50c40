"""GSPO on the embedded arithmetic task: GRPO's dataflow with the PPO clip on a sequence-level
importance ratio (the geometric mean of the token ratios), clipped to [1 - 3e-4, 1 + 4e-4] as
in the GSPO recipe, and a per-sequence token mean."""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.algorithm = "gspo"
    c.actor.policy_loss = "gspo"
    c.actor.loss_agg_mode = "seq-mean-token-mean"
    c.actor.clip_ratio_low = 3e-4
    c.actor.clip_ratio_high = 4e-4
    c.trainer.out_dir = "runs/gspo_arith"
    return c
