"""Runs training configs ("arms") over several seeds and prints each arm's held-out accuracy:
per seed with its Wilson interval over the held-out prompts, and the mean over seeds with its
95% Student-t interval, then, for every two arms, whether their intervals overlap (arms whose
intervals overlap are not told apart by this measurement) and the mean of their per-seed
differences with its Student-t interval (paired by seed: told apart when it excludes 0).

    python scripts/seeds.py --seeds=3 configs/ppo_arith.py configs/grpo_arith.py
    python scripts/seeds.py --seeds=3 configs/grpo_arith.py --set=actor.lr=3e-4 --out=runs/lr

An arm is a config file, optionally followed by its own overrides after `@`:
`configs/grpo_arith.py@async_rollout.max_staleness=8@algo.rollout_correction.rollout_is=none`.
Each run is `python -m launch.train --config=CONFIG --config.seed=S
--config.trainer.resume=disable --config.trainer.out_dir=OUT/<arm>_s<S>` plus the `--set`
overrides, then the arm's own; its last line (JSON) is kept as result.json in its folder, and
`--reuse` reads that instead of training again. Seeds change the model's initialisation, the
warm start, the sampling and the held-out problems drawn (always from the task's held-out third,
hfjax.data.holdout). The runs go seed by seed (every arm's seed 0 first).

Arms compared on one warm start differ only in their RL: write it once with `python -m
launch.sft` and give every arm `--set=model.path=<its out_dir>/hf --set=sft.steps=0`.
`--curve=METRIC` (repeatable) prints a metric of the runs' metrics.jsonl (e.g.
`critic/score/mean`, the sampled reward) at its first step, every `--curve_every` steps and
the last, per arm, as its mean over seeds (at steps every seed logged it).

Under HFJAX_SMOKE=1 (CI's smoke tier) one seed runs per arm, each run shrunk by launch.smoke; an
arm of one seed is given its Wilson interval.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hfjax.run import intervals, records  # noqa: E402  (after the path: run as a file)
from launch import smoke  # noqa: E402


def parse_arm(spec: str) -> tuple[str, str, list[str]]:
    """(name, config path, overrides) of an arm written `CONFIG[@KEY=VALUE...]`."""
    config, *overrides = spec.split("@")
    if not os.path.isfile(config):
        raise SystemExit(f"no such config file: {config}; give paths such as "
                         "configs/ppo_arith.py")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise SystemExit(f"arm {spec}: override {bad[0]!r} is not KEY=VALUE")
    name = "@".join([os.path.splitext(os.path.basename(config))[0], *overrides])
    return name, os.path.abspath(config), overrides


def _train(cmd: list[str], out_dir: str, what: str) -> dict:
    """Runs `cmd` (launch.train: its last stdout line is JSON) and keeps that line."""
    print(f"running {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise SystemExit(f"{what} failed (exit {proc.returncode}): "
                         f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    result = json.loads(lines[-1])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)
    return result


def run_one(config: str, seed: int, out_dir: str, overrides: list[str], reuse: bool,
            flags: list[str]) -> dict:
    """One arm's run for one seed: its final JSON line (trained now, or read with `reuse`)."""
    saved = os.path.join(out_dir, "result.json")
    if reuse and os.path.isfile(saved):
        with open(saved) as f:
            return json.load(f)
    return _train([sys.executable, "-m", "launch.train", f"--config={config}",
                   f"--config.seed={seed}", "--config.trainer.resume=disable",
                   f"--config.trainer.out_dir={out_dir}", *flags,
                   *(f"--config.{o}" for o in overrides)], out_dir, f"{config} seed {seed}")


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


def compare(a: str, b: str, found: dict, after: dict) -> None:
    """Prints whether two arms' intervals overlap and, over two or more seeds, their paired
    per-seed difference with its Student-t interval."""
    (ma, la, ha), (mb, lb, hb) = after[a], after[b]
    verdict = ("overlap: the two are within each other's intervals, not told apart"
               if la <= hb and lb <= ha else "do not overlap")
    print(f"{a} vs {b}: after {ma:.3f} vs {mb:.3f} ({ma - mb:+.3f}); intervals {verdict}")
    diffs = [ra["heldout_accuracy_after"] - rb["heldout_accuracy_after"]
             for ra, rb in zip(found[a], found[b])]
    if len(diffs) > 1:
        mean, lo, hi = intervals.over_seeds(diffs)
        told = "excludes 0: told apart" if lo > 0 or hi < 0 else "includes 0: not told apart"
        print(f"  paired by seed: difference {mean:+.3f} [{lo:+.3f}, {hi:+.3f}], {told}")


def curves(names: list[str], out: str, seeds: int, metric: str, every: int) -> None:
    """Prints `metric` from each run's metrics.jsonl at its first logged step, every `every`
    steps and its last, as the mean over seeds."""
    print(f"{metric}, mean over {seeds} seed(s):")
    for name in names:
        series = {}
        for s in range(seeds):
            path = os.path.join(out, f"{name}_s{s}", "metrics.jsonl")
            for r in (records.read_jsonl(path) if os.path.isfile(path) else []):
                if metric in r:
                    series.setdefault(r["step"], []).append(r[metric])
        steps = sorted(st for st, vs in series.items() if len(vs) == seeds)
        shown = [st for st in steps if st % every == 0 or st in (steps[0], steps[-1])]
        print(f"  {name}: " + (", ".join(
            f"{st}: {sum(series[st]) / seeds:.3f}" for st in shown) or "not in the runs' logs"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="+", help="CONFIG[@KEY=VALUE...], one per arm")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--cpu_devices", type=int, default=0,
                        help="launch.train's --cpu_devices for every RL run (0: not passed)")
    parser.add_argument("--curve", action="append", default=[], metavar="METRIC",
                        help="a metric to print per step, e.g. critic/score/mean (repeatable)")
    parser.add_argument("--curve_every", type=int, default=10)
    parser.add_argument("--out", default="runs/seeds", help="folder of the runs")
    parser.add_argument("--reuse", action="store_true", help="read finished runs' result.json")
    args = parser.parse_args()
    seeds = min(args.seeds, 1) if smoke.enabled() else args.seeds
    if seeds < 1:
        raise SystemExit(f"--seeds={args.seeds}: run at least one seed")
    arms = [parse_arm(a) for a in args.arms]
    out = os.path.abspath(args.out)
    flags = [f"--cpu_devices={args.cpu_devices}"] if args.cpu_devices else []
    found = {name: [] for name, _, _ in arms}
    for s in range(seeds):
        for name, config, overrides in arms:
            found[name].append(run_one(config, s, os.path.join(out, f"{name}_s{s}"),
                                       [*args.set, *overrides], args.reuse, flags))
    names = [name for name, _, _ in arms]
    after = {name: summary(name, found[name]) for name in names}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            compare(a, b, found, after)
    for metric in args.curve:
        curves(names, out, seeds, metric, args.curve_every)


if __name__ == "__main__":
    main()
