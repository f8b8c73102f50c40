"""GRPO on the embedded arithmetic task with LoRA: after the full-weight warm start, RL trains
rank-16 adapters on every linear projection (alpha 32) while the warm-started weights stay
frozen and serve as the reference (no copy). Adapters take a learning rate 10x the
full-weight recipe's."""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.actor.lora.rank = 16
    c.actor.lora.alpha = 32.0
    c.actor.lora.targets = "all-linear"
    c.actor.lr = 1e-3
    c.trainer.out_dir = "runs/grpo_lora_arith"
    return c
