"""Trains a reward (or cost) model with the Bradley–Terry loss on preference pairs.

    python -m launch.prepare_data --task=arith_prefs --n_train=1000 --n_test=200 \\
        --task_config='{"max_b": 9, "pairs_per_prompt": 4}' --out=data/arith_prefs
    python -m launch.train_rm --config.model.path=runs/sft_arith/hf      # from the SFT policy
    python -m launch.train_rm --config=configs/cost_arith.py             # a cost model

Preference parquet has columns prompt, chosen, rejected (hfjax/data/preferences.py). The run
reports pairwise accuracy on the held-out pairs (rm.val_files) before and after, and writes the
model as an HF *ForSequenceClassification directory, <out_dir>/hf, for `reward_model.path` or
`cost_model.path` of an RL run. The last stdout line is JSON.
"""

import json
import os
import time

from launch import cli

DEFAULT_CONFIG, _CONFIG = cli.define_run_flags("rm_arith.py")


def main(argv):
    del argv
    cfg = _CONFIG.value
    cli.start_run("train_rm", cfg)

    from hfjax.run.rm import RMTrainer

    t0 = time.perf_counter()
    trainer = RMTrainer(cfg)  # a bad setting or file is one line (launch.cli)
    print(f"hfjax train_rm ({cfg.rm.target}): {trainer.train.summary()}", flush=True)

    def log(step, m):
        acc = m.get("val/pairwise_accuracy")
        print(f"  step {step}: loss {m['rm/loss']:.3f}, train accuracy {m['rm/accuracy']:.3f}"
              + ("" if acc is None else f", held-out pairwise accuracy {acc:.3f}"), flush=True)

    result = trainer.fit(on_log=log)
    out = trainer.save(os.path.join(cfg.trainer.out_dir, "hf"))
    print(f"wrote {out}")
    after, before = result["after"], result["before"]
    print(json.dumps({
        "target": cfg.rm.target,
        "heldout_pairwise_accuracy_before": cli.rounded(before.get("val/pairwise_accuracy")),
        "heldout_pairwise_accuracy_after": cli.rounded(after.get("val/pairwise_accuracy")),
        "heldout_sign_accuracy_after": cli.rounded(after.get("val/sign_accuracy")),
        "heldout_pairs": 0 if trainer.val is None else len(trainer.val.pairs),
        "steps": cfg.rm.steps,
        "wall_s": round(time.perf_counter() - t0, 1),
        "out": out,
    }), flush=True)


if __name__ == "__main__":
    cli.run(main, "train_rm", config_default=DEFAULT_CONFIG)
