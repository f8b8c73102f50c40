"""GRPO with reasoning-length responses: Qwen2.5-7B, 16 prompts x 8 samples, prompts of 1024
tokens and responses of 32768, on one node of 8 GPUs, with sequence parallelism.

A training or scoring row is 33792 tokens. The actor and the reference split each row's tokens
four ways over the `sequence` mesh axis (`actor.mesh=fsdp=2,sequence=4`): every device holds
8448 of a row's tokens through the projections, the MLP, the LM head and the log-probs, and
attention crosses the four shards by Ulysses (an all-to-all between tokens and heads: the
7B's 4 kv heads take sequence=4; `actor.sequence_parallel=ring` passes K/V blocks round
instead). Decoding uses whole rows on `rollout.mesh`; the hybrid engine reshards the weights
between the two layouts. The update keeps its matmuls' outputs for the backward pass
(`model.remat_policy=dots_no_batch`), which a device can hold for a quarter of each row and not
for a whole one. Size it before launching (docs/scaling.md, "Long responses"):

    python -m launch.train --dry_run --target=h200 --num_devices=8 --config=configs/grpo_long.py

The data is the embedded arithmetic task (short answers: the shapes are the configured caps);
for real reasoning prompts set data.task=parquet, data.train_files, data.val_files and
model.tokenizer.
"""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.model.path = "preset:qwen2.5-7b"
    c.model.dtype = "auto"
    c.model.param_dtype = "float32"
    # Keep the matmuls' outputs and recompute only the elementwise work in the backward pass
    # (no second forward of every layer, as "full" does): that holds 65.3 GiB of temporaries
    # per device for a quarter row, and fits only because sequence=4 splits each row. The same
    # config with whole rows per device (actor.mesh=fsdp=8) needs 212.8 GiB in actor.update and
    # does not fit; with remat_policy=full it would (docs/scaling.md, "Long responses").
    c.model.remat_policy = "dots_no_batch"
    c.sft.steps = 0
    c.data.train_batch_size = 16
    c.data.max_prompt_length = 1024
    c.data.n_test = 64  # validation: 64 greedy rows, fewer than the 128 of a step
    c.rollout.n = 8
    c.rollout.response_length = 32768
    c.rollout.mesh = "data=2,tensor=4"
    c.actor.mesh = "fsdp=2,sequence=4"
    c.actor.rules = "auto"
    c.actor.sequence_parallel = "ulysses"
    c.ref.mesh = "fsdp=2,sequence=4"
    c.ref.sequence_parallel = "ulysses"
    c.actor.lr = 1e-6
    c.actor.ppo_mini_batch_size = 16  # prompts: one update of 128 sequences per step
    c.actor.ppo_micro_batch_size = 2  # sequences: one row per data-parallel rank
    # launch.plan: the reference scores in micro-batches of the actor's 2 rows, as the run does
    c.plan.score_micro = 2
    c.trainer.out_dir = "runs/grpo_long"
    return c
