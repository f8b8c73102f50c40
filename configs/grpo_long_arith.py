"""GRPO on the embedded arithmetic task with responses of more than 2,048 tokens, rows split over
the `sequence` mesh axis.

Every demonstration of the warm start works the problem in a scratchpad of 147 lines before its
answer (`sft.scratchpad_lines`, `hfjax.data.arith.scratchpad`: "146 47+08=055 145 47+08=055 ...
000 47+08=055 #### 55", 2,058 tokens of scratchpad), and 70% of them give the answer without
the `####` marker the reward reads (`sft.corruption=format`), so a response runs to 2,059-2,067
tokens and RL has the marker to find. The actor and the reference train and score on
`fsdp=2,sequence=4`: each row's tokens split four ways, attention across the shards by
Ulysses (the model has 4 query and 4 KV heads, which sequence=4 divides); generation runs on
`data=8` with whole rows, resharded from the training layout by the hybrid engine. The LM head
takes 2,048 positions per device at a time (`actor.logprob_chunk`). 20 GRPO steps of 8 prompts x 4
samples; greedy accuracy on 32 held-out problems before and after (0.000 and 0.000 when
measured: the 120-step warm start does not teach the scratchpad, so no sample earns a reward;
docs/algorithms.md, "Long responses").

    python -m launch.train --config=configs/grpo_long_arith.py --cpu_devices=8
"""

from configs import grpo_arith

SCRATCHPAD_LINES = 147  # 147 x 14 tokens = 2,058, before the answer


def get_config():
    c = grpo_arith.get_config()
    c.model.num_kv_heads = 4  # Ulysses splits the heads over sequence=4
    c.data.train_batch_size = 8
    c.data.n_test = 32
    c.sft.steps = 120
    c.sft.batch_size = 16
    c.sft.micro_batch_size = 4  # rows of 2,080 tokens: 4 at a time bounds the activations
    c.sft.scratchpad_lines = SCRATCHPAD_LINES
    c.rollout.n = 4
    c.rollout.response_length = 2080  # the longest demonstration (2,067 tokens) and some room
    c.rollout.mesh = "data=8"
    c.actor.mesh = "fsdp=2,sequence=4"
    c.ref.mesh = "fsdp=2,sequence=4"
    c.actor.sequence_parallel = "ulysses"
    c.ref.sequence_parallel = "ulysses"
    c.actor.ppo_mini_batch_size = 8  # prompts: 8 x 4 = 32 sequences per update
    c.actor.ppo_micro_batch_size = 8  # two groups of 4 samples per micro-batch
    c.actor.logprob_chunk = 2048
    c.trainer.total_steps = 20
    c.trainer.test_freq = 20
    c.trainer.save_freq = 20
    c.trainer.log_every = 1
    c.trainer.out_dir = "runs/grpo_long_arith"
    return c
