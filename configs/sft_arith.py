"""SFT on the embedded arithmetic task (python -m launch.sft): the default job's warm start as a
run of its own, 1000 steps on the deliberately imperfect demonstrations (sft.corruption), the
same numbers the default job's warm start computes. The policy is written to
<out_dir>/hf, which `launch.train` starts from (--config.model.path=<out_dir>/hf
--config.sft.steps=0). For your own data set sft.train_files (and sft.val_files) to SFT
parquet and model.path to the model to fine-tune."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.trainer.out_dir = "runs/sft_arith"
    return c
