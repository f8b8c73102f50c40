"""DPO on the embedded arithmetic task (python -m launch.train_dpo): the default job's SFT warm
start, then DPO against its frozen copy on preference pairs where the exact answer after `####`
is preferred to the bare answer, a wrong answer or junk (python -m launch.prepare_data
--task=arith_prefs --out=data/arith_prefs writes them); held-out accuracy by greedy generation
before and after. The policy is written to <out_dir>/hf."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.dpo.train_files = "data/arith_prefs/train.parquet"
    c.dpo.val_files = "data/arith_prefs/test.parquet"
    c.trainer.out_dir = "runs/dpo_arith"
    return c
