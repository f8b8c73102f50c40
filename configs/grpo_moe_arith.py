"""GRPO on the embedded arithmetic task (configs/grpo_arith.py) with the mixture-of-experts
policy of configs/ppo_moe_arith.py: 8 experts of width 192, top-2, dropless, load-balancing
loss 0.01, and the same warm start and RL lengths. Results, with and without routing
replay, in docs/architecture.md, "A tiny mixture of experts learns"."""

from configs import grpo_arith, ppo_moe_arith


def get_config():
    c = grpo_arith.get_config()
    moe = ppo_moe_arith.get_config()
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        c.model[key] = moe.model[key]
    c.actor.moe_aux_loss_coef = moe.actor.moe_aux_loss_coef
    c.sft.steps = moe.sft.steps
    for key in ("total_steps", "test_freq", "save_freq"):
        c.trainer[key] = moe.trainer[key]
    c.trainer.out_dir = "runs/grpo_moe_arith"
    return c
