"""PPO with Llama-3.1-8B as actor, critic and reference, colocated on one node of 8 GPUs.

The accelerator setting of the default job's algorithm: bfloat16 compute over float32 master
weights and optimizer state (`model.dtype=auto` is bfloat16 on GPUs and TPUs), remat of every
layer, the actor trained FSDP over the 8 devices in the hybrid engine's nested layout and
decoding with tensor parallelism 4. `model.path` is the preset (the architecture with random
weights); point it at real weights (an HF directory) to train them. Size it before launching:

    python -m launch.train --config=configs/ppo_llama8b.py --dry_run --target=h200 \\
        --num_devices=8
    python -m launch.train --config=configs/ppo_llama8b.py --dry_run --target=h200 \\
        --num_devices=8 --config.model.path=preset:llama3.1-70b

The data is the embedded arithmetic task (its tokenizer's ids are valid Llama ids); for real
prompts set data.task=parquet, data.train_files, data.val_files and model.tokenizer.
"""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.model.path = "preset:llama3.1-8b"
    c.model.dtype = "auto"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "full"
    c.data.max_prompt_length = 512
    c.data.train_batch_size = 256
    c.rollout.response_length = 512
    c.sft.steps = 0
    c.actor.mesh = "fsdp=8"
    c.actor.rules = "nested_train"
    c.rollout.mesh = "data=2,tensor=4"
    c.ref.mesh = "fsdp=8"
    c.critic.mesh = "fsdp=8"
    c.actor.lr = 1e-6
    c.critic.lr = 1e-5
    c.actor.ppo_mini_batch_size = 64  # prompts: 4 updates per step
    c.actor.ppo_micro_batch_size = 16  # sequences: 2 per device
    c.critic.ppo_mini_batch_size = 64
    c.critic.ppo_micro_batch_size = 16
    c.trainer.out_dir = "runs/ppo_llama8b"
    return c
