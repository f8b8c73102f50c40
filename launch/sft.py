"""Supervised fine-tuning of a policy, on any data and any mesh.

    python -m launch.sft                                   # the embedded task's demonstrations
    python -m launch.sft --config.sft.train_files=data/sft/train.parquet \\
        --config.sft.val_files=data/sft/test.parquet --config.model.path=path/to/hf_dir
    python -m launch.sft --cpu_devices=8 --config.actor.mesh=fsdp=4,tensor=2

The data is verl-style SFT parquet (prompt/response columns, or multi-turn `messages`; see
hfjax/data/sft.py), with the loss on response tokens only. The run reports held-out loss (and,
for the embedded task or with prompt files in data.val_files, held-out accuracy by greedy
generation) before and after, and writes the policy with its tokenizer as an HF directory,
<out_dir>/hf, which `python -m launch.train --config.model.path=<out_dir>/hf
--config.sft.steps=0` starts RL from. The last stdout line is JSON.
"""

import json
import os
import time

from launch import cli

DEFAULT_CONFIG, _CONFIG = cli.define_run_flags("sft_arith.py")


def main(argv):
    del argv
    cfg = _CONFIG.value
    cli.start_run("sft", cfg)
    import jax

    from hfjax.run.sft import SFTTrainer

    t0 = time.perf_counter()
    trainer = SFTTrainer(cfg)  # a bad setting or file is one line (launch.cli)
    print(f"hfjax sft: {trainer.train.summary()}; {jax.device_count()} "
          f"{jax.devices()[0].platform} devices, mesh={cfg.actor.mesh}", flush=True)
    result = trainer.fit(on_log=lambda i, m: print(
        f"  sft step {i}: loss {m['sft/loss']:.3f}", flush=True))
    out = trainer.save(os.path.join(cfg.trainer.out_dir, "hf"))
    print(f"wrote {out}")
    acc = {k: v for k, v in result["after"].items() if k.startswith("val-core/")}
    print(json.dumps({
        "heldout_loss_before": cli.rounded(result["before"].get("val/sft_loss")),
        "heldout_loss_after": cli.rounded(result["after"].get("val/sft_loss")),
        "heldout_accuracy_before": cli.rounded(next(
            (v for k, v in result["before"].items() if k.startswith("val-core/")), None)),
        "heldout_accuracy_after": cli.rounded(next(iter(acc.values()), None)),
        "steps": cfg.sft.steps,
        "wall_s": round(time.perf_counter() - t0, 1),
        "out": out,
    }), flush=True)


if __name__ == "__main__":
    cli.run(main, "sft", config_default=DEFAULT_CONFIG)
