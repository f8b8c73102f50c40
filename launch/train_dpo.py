"""Trains a policy with DPO (or IPO, SimPO) on preference pairs.

    python -m launch.prepare_data --task=arith_prefs --n_train=1000 --n_test=200 \\
        --task_config='{"max_b": 9, "pairs_per_prompt": 4}' --out=data/arith_prefs
    python -m launch.train_dpo --config=configs/dpo_arith.py
    python -m launch.train_dpo --config=configs/dpo_arith.py --config.dpo.loss_type=simpo

The data is the preference parquet launch.train_rm reads (columns prompt, chosen, rejected).
The policy starts from model.path (or a fresh model), warm-started by SFT when sft.steps > 0;
the reference (a frozen copy on the `ref` pool) scores every pair once. The run reports the
preference metrics on the held-out pairs (dpo.val_files) and, for the embedded task, held-out
accuracy by greedy generation, before and after, and writes the policy as an HF directory,
<out_dir>/hf, which launch.train starts from. The last stdout line is JSON.
"""

import json
import os
import time

from launch import cli

DEFAULT_CONFIG, _CONFIG = cli.define_run_flags("dpo_arith.py")


def main(argv):
    del argv
    cfg = _CONFIG.value
    cli.start_run("train_dpo", cfg)

    from hfjax.run.dpo import DPOTrainer

    t0 = time.perf_counter()
    trainer = DPOTrainer(cfg)  # a bad setting or file is one line (launch.cli)
    print(f"hfjax train_dpo ({cfg.dpo.loss_type}): {trainer.train.summary()}", flush=True)

    def log(step, m):
        acc = m.get("val/rewards/accuracies")
        print(f"  step {step}: loss {m['dpo/loss']:.3f}, reward margin "
              f"{m['rewards/margins']:.3f}" + ("" if acc is None else
                                                f", held-out reward accuracy {acc:.3f}"),
              flush=True)

    result = trainer.fit(on_log=log)
    out = trainer.save(os.path.join(cfg.trainer.out_dir, "hf"))
    print(f"wrote {out}")
    after, before = result["after"], result["before"]
    accuracy = [k for k in after if k.startswith("val-core/")]
    print(json.dumps({
        "loss_type": cfg.dpo.loss_type,
        "heldout_reward_accuracy_before": cli.rounded(before.get("val/rewards/accuracies")),
        "heldout_reward_accuracy_after": cli.rounded(after.get("val/rewards/accuracies")),
        "heldout_accuracy_before": cli.rounded(before.get(accuracy[0]) if accuracy else None),
        "heldout_accuracy_after": cli.rounded(after.get(accuracy[0]) if accuracy else None),
        "heldout_pairs": 0 if trainer.val is None else len(trainer.val.pairs),
        "steps": cfg.dpo.steps,
        "wall_s": round(time.perf_counter() - t0, 1),
        "out": out,
    }), flush=True)


if __name__ == "__main__":
    cli.run(main, "train_dpo", config_default=DEFAULT_CONFIG)
