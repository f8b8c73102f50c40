"""Runs training configs ("arms") over several seeds and prints each arm's held-out accuracy:
per seed with its Wilson interval over the held-out prompts, and the mean over seeds with its
95% Student-t interval, then, for every two arms, whether their intervals overlap (arms whose
intervals overlap are not told apart by this measurement).

    python scripts/seeds.py --seeds=3 configs/ppo_arith.py configs/grpo_arith.py
    python scripts/seeds.py --seeds=3 configs/grpo_arith.py --set=actor.lr=3e-4 --out=runs/lr

Each run is `python -m launch.train --config=ARM --config.seed=S --config.trainer.resume=disable
--config.trainer.out_dir=OUT/<arm>_s<S>` plus the `--set` overrides; its last line (JSON) is kept
as result.json in its folder, and `--reuse` reads that instead of training again. Seeds change the
model's initialisation, the warm start, the sampling and the held-out problems drawn (always from
the task's held-out third, hfjax.data.holdout). Under HFJAX_SMOKE=1 (CI's smoke tier) one seed
runs per arm, each run shrunk by launch.smoke; an arm of one seed is given its Wilson interval.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hfjax.run import intervals  # noqa: E402  (after the path: run as a file)
from launch import smoke  # noqa: E402


def run_one(config: str, seed: int, out_dir: str, overrides: list[str], reuse: bool) -> dict:
    """One arm's run for one seed: its final JSON line (trained now, or read with `reuse`)."""
    saved = os.path.join(out_dir, "result.json")
    if reuse and os.path.isfile(saved):
        with open(saved) as f:
            return json.load(f)
    cmd = [sys.executable, "-m", "launch.train", f"--config={config}", f"--config.seed={seed}",
           "--config.trainer.resume=disable", f"--config.trainer.out_dir={out_dir}",
           *(f"--config.{o}" for o in overrides)]
    print(f"running {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise SystemExit(f"{config} seed {seed} failed (exit {proc.returncode}): "
                         f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    result = json.loads(lines[-1])
    os.makedirs(out_dir, exist_ok=True)
    with open(saved, "w") as f:
        json.dump(result, f)
    return result


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def summary(name: str, results: list[dict]) -> tuple[float, float, float]:
    """Prints an arm's per-seed and over-seeds lines; returns (mean, lo, hi) after RL."""
    print(f"{name}:")
    for seed, r in enumerate(results):
        if r.get("heldout_accuracy_after") is None:
            raise SystemExit(f"{name} seed {seed}: the run reported no held-out accuracy after "
                             "RL; give it validation (trainer.test_freq) and steps")
        lo, hi = intervals.accuracy_interval(r["heldout_accuracy_after"], r["heldout_prompts"])
        print(f"  seed {seed}: before {_num(r['heldout_accuracy_before'])}, after "
              f"{r['heldout_accuracy_after']:.3f} {intervals.fmt(lo, hi)} on "
              f"{r['heldout_prompts']} prompts, {r['wall_s']:.0f} s")
    befores = [r["heldout_accuracy_before"] for r in results
               if r["heldout_accuracy_before"] is not None]
    before = intervals.over_seeds(befores) if befores else None
    after = intervals.over_seeds([r["heldout_accuracy_after"] for r in results])
    said_before = "n/a" if before is None else f"{before[0]:.3f} {intervals.fmt(*before[1:])}"
    if len(results) == 1:  # one seed has no spread to measure: its test set's interval
        r = results[0]
        after = (after[0], *intervals.accuracy_interval(after[0], r["heldout_prompts"]))
        print(f"  one seed (Wilson interval): after {after[0]:.3f} {intervals.fmt(*after[1:])}")
        return after
    print(f"  mean over {len(results)} seeds (Student t): before {said_before}, after "
          f"{after[0]:.3f} {intervals.fmt(*after[1:])}")
    return after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="+", help="config files, one per arm")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--out", default="runs/seeds", help="folder of the runs")
    parser.add_argument("--reuse", action="store_true", help="read finished runs' result.json")
    args = parser.parse_args()
    seeds = min(args.seeds, 1) if smoke.enabled() else args.seeds
    if seeds < 1:
        raise SystemExit(f"--seeds={args.seeds}: run at least one seed")
    missing = [a for a in args.arms if not os.path.isfile(a)]
    if missing:
        raise SystemExit(f"no such config file: {', '.join(missing)}; give paths such as "
                         "configs/ppo_arith.py")
    names = [os.path.splitext(os.path.basename(a))[0] for a in args.arms]
    out = os.path.abspath(args.out)
    found = {}
    for arm, name in zip(args.arms, names):
        found[name] = [run_one(os.path.abspath(arm), s, os.path.join(out, f"{name}_s{s}"),
                               args.set, args.reuse) for s in range(seeds)]
    after = {name: summary(name, found[name]) for name in names}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (ma, la, ha), (mb, lb, hb) = after[a], after[b]
            verdict = ("overlap: the two are within each other's intervals, not told apart"
                       if la <= hb and lb <= ha else "do not overlap")
            print(f"{a} vs {b}: after {ma:.3f} vs {mb:.3f} ({ma - mb:+.3f}); intervals "
                  f"{verdict}")


if __name__ == "__main__":
    main()
