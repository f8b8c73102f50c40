"""GRPO with a calculator: the embedded tiny model on products of 3- and 4-digit numbers
(`data.task=arith_tool`), which it cannot work out in its head.

The warm start's demonstrations are deliberately imperfect tool use: only half of them call the
calculator (`<tool_call>{"name": "calculator", ...}</tool_call>`), read its result and answer
`#### N`; the rest answer straight away (`sft.corrupt_frac=0.5`). RL rolls out multi-turn
trajectories (docs/agents.md): a policy turn, the calculator's result as context the loss does
not see, and the answer. The same config without tools,
    python -m launch.train --config=configs/grpo_tool_arith.py \\
        --config.rollout.multi_turn.tools=
leaves every call an error observation (unknown tool), so only the answers the model can work
out itself score. Results and commands: docs/algorithms.md.
"""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.data.task = "arith_tool"
    c.data.max_prompt_length = 12  # "dddd*dddd=" is 10 tokens
    c.data.n_test = 64
    c.data.train_batch_size = 16
    c.rollout.n = 8
    c.actor.ppo_mini_batch_size = 16  # prompts: 16 x 8 = 128 trajectories per update
    c.actor.ppo_micro_batch_size = 128
    # A call (27 tokens), its result (at most 10) and the answer (at most 14) fit in 64.
    c.rollout.response_length = 64
    m = c.rollout.multi_turn
    m.enable = True
    m.tools = "calculator"
    m.max_turns = 2
    m.max_tool_response_len = 16
    c.sft.steps = 600
    c.sft.batch_size = 64
    c.sft.micro_batch_size = 64
    c.sft.corrupt_frac = 0.5  # half of the demonstrations skip the tool
    c.trainer.total_steps = 20
    c.trainer.test_freq = 10
    c.trainer.save_freq = 20
    c.trainer.out_dir = "runs/grpo_tool_arith"
    return c
