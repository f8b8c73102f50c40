"""GRPO at length: responses of more than 1,024 tokens whose answer only a slip-free chain of
arithmetic reaches, rows split over the `sequence` mesh axis.

The task is `data.task=arith_chain` (hfjax.data.arith.chain): "47+8=" asks for 47 + 79 * 8,
worked as 79 fixed-width lines counting down, each adding 8 to the sum the line before ended
with ("78 047+8=055 77 055+8=063 ... 00 671+8=679 ## 679"), 1,027 tokens of chain and a closing
line: every token is a function of the tokens a line or less before it, so a warm start can
learn it to a low loss, and one wrong digit anywhere moves every later sum and the answer. The
closing line has a chain line's shape (the marker `##` where the counter goes, the answer where
the next line's first sum goes), so the answer is copied as every line's first sum is. The
reward (`hfjax/arith_chain`) is 1 for a response that ends in `## <answer>`. 60% of the
warm-start demonstrations stop after the chain's last line (`sft.corruption=format`), so greedy
decoding after the warm start writes the chain and stops, scoring 0; rollouts at temperature
0.4 keep most chains whole while writing the closing line in some, and GRPO has it to find at
the end of 1,030 tokens.

The actor and the reference train and score on `fsdp=2,sequence=4`: each row's tokens split four
ways, attention across the shards by Ulysses (the model has 4 query and 4 KV heads, which
sequence=4 divides); generation runs on `data=8` with whole rows, resharded from the training
layout by the hybrid engine. Held-out greedy accuracy on 32 problems before and after
(docs/algorithms.md, "Long responses", gives the measured run).

    python -m launch.train --config=configs/grpo_long_arith.py --cpu_devices=8
"""

from configs import grpo_arith

CHAIN_STEPS = 79  # 79 lines x 13 tokens = 1,027 tokens of chain, before "#### <answer>"


def get_config():
    c = grpo_arith.get_config()
    c.model.num_kv_heads = 4  # Ulysses splits the heads over sequence=4
    c.data.task = "arith_chain"
    c.data.chain_steps = CHAIN_STEPS
    c.data.train_batch_size = 8
    c.data.n_test = 32
    c.sft.steps = 1000  # the chain and its closing line learned to a loss near 0.001
    c.sft.lr_schedule = "cosine"  # settles the chain to a low loss by the end of the warm start
    c.sft.batch_size = 8
    c.sft.micro_batch_size = 8
    c.sft.corrupt_frac = 0.6
    c.rollout.n = 4
    # Cool enough that most samples keep the chain whole, warm enough that the marker (40% of
    # the demonstrations) still comes out in about a quarter of them.
    c.rollout.temperature = 0.4
    c.rollout.response_length = 1048  # the longest response (1,036 tokens) and some room
    c.rollout.mesh = "data=8"
    c.actor.mesh = "fsdp=2,sequence=4"
    c.ref.mesh = "fsdp=2,sequence=4"
    c.actor.sequence_parallel = "ulysses"
    c.ref.sequence_parallel = "ulysses"
    c.actor.lr = 5e-5  # 5e-4 undid the warm start in 9 steps (sampled reward 0.59 -> 0)
    c.actor.ppo_mini_batch_size = 8  # prompts: 8 x 4 = 32 sequences per update
    c.actor.ppo_micro_batch_size = 8  # two groups of 4 samples per micro-batch
    c.actor.logprob_chunk = 2048
    c.trainer.total_steps = 20
    c.trainer.test_freq = 10
    c.trainer.save_freq = 20
    c.trainer.log_every = 1
    c.trainer.out_dir = "runs/grpo_long_arith"
    return c
