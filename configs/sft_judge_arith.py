"""A generative judge for the embedded arithmetic task, trained by SFT (python -m launch.sft): a
fresh tiny model learns to write the right answer, then 1 if the answer shown is the exact one
(`#### N`, what the rule reward scores 1) and 0 for any other answer, from the SFT rows that
`launch.prepare_data --task=arith_judge` writes to data/arith_judge. It is written to
runs/judge_arith/judge/hf, which configs/ppo_judge_arith.py reads as reward.judge.path
(docs/algorithms.md)."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.sft.train_files = "data/arith_judge/train.parquet"
    c.sft.val_files = "data/arith_judge/test.parquet"
    c.sft.steps = 1000
    c.sft.max_response_length = 7  # the judge's answer, a space, the verdict, the end token
    # The judge's prompt: "a+b=", an answer of up to rollout.response_length tokens, "==".
    c.data.max_prompt_length = 24
    c.trainer.out_dir = "runs/judge_arith/judge"
    return c
