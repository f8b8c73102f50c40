"""Classic RLHF on the embedded arithmetic task: PPO from the SFT policy against a learned
reward model, with no rule reward (reward.rule_weight=0; held-out accuracy is still scored by
the exact-answer rule). scripts/rlhf_arith.sh makes the SFT policy and the reward model."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.model.path = "runs/rlhf_arith/sft/hf"
    c.sft.steps = 0  # the SFT stage ran on its own (launch.sft)
    c.reward_model.path = "runs/rlhf_arith/rm/hf"
    c.reward.rule_weight = 0.0
    c.reward.model_weight = 1.0
    c.trainer.out_dir = "runs/rlhf_arith/ppo"
    return c
