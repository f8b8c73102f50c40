"""configs/grpo_smollm2_arith.py with LoRA: rank-16 adapters (alpha 32) on every linear
projection of SmolLM2-135M-Instruct train instead of its weights, which stay frozen and are
the reference (no copy); the adapters take 10x the full-weight recipe's learning rate.

    python -m launch.train --config=configs/grpo_smollm2_lora_arith.py

Same data and reward as the full-weight recipe (prepare data/chain_sum as its docstring
says). Held-out greedy accuracy 0.090 -> 0.335 after the 60 steps (docs/algorithms.md, "LoRA
measured").
"""

from configs import grpo_smollm2_arith


def get_config():
    c = grpo_smollm2_arith.get_config()
    c.actor.lora.rank = 16
    c.actor.lora.alpha = 32.0
    c.actor.lora.targets = "all-linear"
    c.actor.lr = 1e-4
    c.trainer.out_dir = "runs/grpo_smollm2_lora_arith"
    return c
