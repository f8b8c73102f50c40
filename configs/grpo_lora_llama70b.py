"""GRPO with LoRA on Llama-3.1-70B, on one node of 8 GPUs.

Rank-64 adapters on every linear projection (alpha 128) train in float32 with their Adam
state; the 70B base stays frozen in bfloat16 (no gradient, no optimizer state) and is also the
reference (adapters off: no second copy). bfloat16 compute, remat of every layer, training
`fsdp=8` in the hybrid engine's nested layout, decoding a merged copy with `tensor=8`.
`model.path` is the preset (the architecture with random weights); point it at real weights
(an HF directory) to train them. Size it before launching:

    python -m launch.train --dry_run --target=h200 --num_devices=8 \\
        --config=configs/grpo_lora_llama70b.py

The data is the embedded arithmetic task (its tokenizer's ids are valid Llama ids); for real
prompts set data.task=parquet, data.train_files, data.val_files and model.tokenizer.
"""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.model.path = "preset:llama3.1-70b"
    c.model.dtype = "auto"
    c.model.param_dtype = "bfloat16"
    c.model.remat_policy = "full"
    c.data.max_prompt_length = 512
    c.data.train_batch_size = 32
    c.rollout.n = 8
    c.rollout.response_length = 512
    c.sft.steps = 0
    c.actor.mesh = "fsdp=8"
    c.actor.rules = "nested_train"
    c.rollout.mesh = "tensor=8"
    c.ref.mesh = "fsdp=8"
    c.actor.lora.rank = 64
    c.actor.lora.alpha = 128.0
    c.actor.lora.targets = "all-linear"
    c.actor.lr = 1e-5
    c.actor.ppo_mini_batch_size = 16  # prompts: 128 sequences, 2 updates per step
    c.actor.ppo_micro_batch_size = 16  # sequences: 2 per device
    c.trainer.out_dir = "runs/grpo_lora_llama70b"
    return c
