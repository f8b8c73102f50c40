"""A reward model for the embedded arithmetic task (python -m launch.train_rm): a score head on
the SFT policy's trunk (model.path), trained with the Bradley–Terry loss on pairs where the
exact answer after `####` is preferred to the bare answer, a wrong answer or junk
(python -m launch.prepare_data --task=arith_prefs writes them), and scored by its pairwise
accuracy on held-out prompts' pairs. The model is written to <out_dir>/hf."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.model.path = "runs/rlhf_arith/sft/hf"  # the trunk to start from; empty: from scratch
    c.rm.train_files = "runs/rlhf_arith/prefs/train.parquet"
    c.rm.val_files = "runs/rlhf_arith/prefs/test.parquet"
    c.trainer.out_dir = "runs/rlhf_arith/rm"
    return c
