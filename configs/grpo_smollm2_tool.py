"""GRPO with the calculator on SmolLM2-135M-Instruct, warm-started by SFT on tool-use
demonstrations (configs/sft_smollm2_tool.py; ReTool's recipe). The task: reasoning-gym's
basic_arithmetic products of two numbers of 3-4 digits ("Calculate 663 * 4242."), which the
135M model cannot work out in its head. SmolLM2's chat template ignores a `tools` list, so
`--tools=calculator` starts every prompt with a system message that describes the tool and
the `<tool_call>` format (docs/agents.md); `--sft_demos` writes the demonstrations.

    python -m launch.prepare_data --task=basic_arithmetic --tools=calculator --sft_demos \\
        --n_train=512 --n_test=100 --out=data/smollm2_tool --task_config='{"min_terms": 2,
        "max_terms": 2, "min_digits": 3, "max_digits": 4, "operators": ["*"],
        "allow_parentheses": false, "allow_negation": false}'
    python -m launch.sft --config=configs/sft_smollm2_tool.py
    python -m launch.train --config=configs/grpo_smollm2_tool.py

Multi-turn rollouts (at most 2 policy turns: a call, then the answer after the tool's result)
with 8 samples per prompt, group-normalised advantages and a low-variance KL loss against the
warm-started model. The reward is the last number of the policy's own turns against the answer
(configs/last_number_reward.py): the tool's result is context, so the policy scores only when
it writes the answer itself. `--config.rollout.multi_turn.tools=` runs the same recipe without
the tool (every call is answered with an error). Results: docs/algorithms.md.
"""

from configs import grpo_smollm2


def get_config():
    c = grpo_smollm2.get_config()
    c.model.path = "runs/sft_smollm2_tool/hf"  # configs/sft_smollm2_tool.py writes it
    c.data.train_files = "data/smollm2_tool/train.parquet"
    c.data.val_files = "data/smollm2_tool/test.parquet"
    c.reward.custom_fn = "configs/last_number_reward.py:last_number"
    # The system message describing the calculator makes a prompt about 320 tokens.
    c.data.max_prompt_length = 336
    c.data.train_batch_size = 4
    c.rollout.n = 8  # 4 prompts x 8 samples = 32 trajectories per step
    # A call (37 tokens), the tool turn (18) and "#### N" (about 8) fit in 96.
    c.rollout.response_length = 96
    c.sft.max_response_length = 96
    m = c.rollout.multi_turn
    m.enable = True
    m.tools = "calculator"
    m.max_turns = 2
    m.max_tool_response_len = 32
    c.trainer.total_steps = 4
    c.trainer.test_freq = 0  # held-out accuracy: launch.evaluate, before and after
    c.trainer.val_before_train = False
    c.trainer.save_freq = 4
    c.trainer.out_dir = "runs/grpo_smollm2_tool"
    return c


def untuned_weights() -> str:
    """The untuned SmolLM2-135M-Instruct GGUF (empty when not installed)."""
    return grpo_smollm2._default_weights()
