"""A cost model for the embedded arithmetic task (python -m launch.train_rm
--config=configs/cost_arith.py): trained on pairs of answers in the same format where the one
that writes the forbidden digit 7 is the costlier (python -m launch.prepare_data
--task=arith_cost_prefs), with Safe-RLHF's sign term so that a costly response scores above 0.
The property is checkable: `hfjax.data.arith.forbidden_digit_cost` is the rule it learns, and
Safe-RLHF runs report that rule on their validation answers next to the model's scores."""

from configs import rm_arith


def get_config():
    c = rm_arith.get_config()
    c.rm.target = "cost"
    c.rm.train_files = "runs/rlhf_arith/cost_prefs/train.parquet"
    c.rm.val_files = "runs/rlhf_arith/cost_prefs/test.parquet"
    c.rm.sign_coef = 1.0
    c.rm.center_coef = 0.0
    c.trainer.out_dir = "runs/rlhf_arith/cost"
    return c
