"""The 95% intervals: Wilson's against an independent computation (the set of proportions a
score test does not reject, found by scanning), the seeds' against scipy's Student t, and
scripts/seeds.py's report on finished runs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from hfjax.run.intervals import accuracy_interval, over_seeds, wilson

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scanned(k, n, z=1.959963984540054):
    """The proportions p whose score test accepts k of n: |k/n - p| <= z sqrt(p (1-p) / n),
    by brute force on a fine grid."""
    grid = np.linspace(0.0, 1.0, 200_001)
    accept = grid[np.abs(k / n - grid) <= z * np.sqrt(grid * (1 - grid) / n)]
    return accept.min(), accept.max()


@pytest.mark.parametrize("k,n", [(0, 16), (3, 16), (8, 10), (480, 512), (512, 512), (1, 1)])
def test_wilson_matches_the_scanned_score_test(k, n):
    lo, hi = wilson(k, n)
    slo, shi = _scanned(k, n)
    assert lo == pytest.approx(slo, abs=2e-5) and hi == pytest.approx(shi, abs=2e-5)
    assert lo <= k / n <= hi


def test_wilson_known_value_and_width_at_the_default_test_size():
    # 8 of 10: the textbook Wilson interval (0.490, 0.943).
    assert wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    # 512 prompts keep the half-width within 3 points from 0.85 up (the docs' comparisons).
    lo, hi = accuracy_interval(0.85, 512)
    assert (hi - lo) / 2 < 0.031
    with pytest.raises(ValueError, match="successes"):
        wilson(5, 4)


def test_over_seeds_matches_student_t():
    values = [0.93, 0.95, 0.96]
    mean, lo, hi = over_seeds(values)
    want = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values),
                            scale=stats.sem(values))
    assert mean == pytest.approx(np.mean(values))
    assert (lo, hi) == pytest.approx(want, abs=1e-3)
    assert over_seeds([0.5]) == (0.5, 0.5, 0.5)


def _result(after, before=0.1, n=512):
    return {"heldout_accuracy_before": before, "heldout_accuracy_after": after,
            "heldout_prompts": n, "wall_s": 1.0}


def test_seeds_script_reports_arms_and_whether_they_overlap(tmp_path):
    # Finished runs (result.json and metrics.jsonl, as the script and a run write them) of four
    # arms over 3 seeds, one of them a config with its own override after `@`.
    arms = {"ppo_arith": [0.95, 0.96, 0.94], "grpo_arith": [0.955, 0.945, 0.96],
            "remax_arith": [0.60, 0.62, 0.61], "grpo_arith@actor.lr=1e-3": [0.945, 0.935, 0.95]}
    for arm, afters in arms.items():
        for seed, after in enumerate(afters):
            os.makedirs(tmp_path / f"{arm}_s{seed}")
            with open(tmp_path / f"{arm}_s{seed}" / "result.json", "w") as f:
                json.dump(_result(after), f)
            with open(tmp_path / f"{arm}_s{seed}" / "metrics.jsonl", "w") as f:
                f.write(json.dumps({"step": 0, "val": 0.5}) + "\n")  # before RL: no reward
                for step in range(1, 5):
                    f.write(json.dumps({"step": step, "critic/score/mean": step + seed}) + "\n")
    out = subprocess.run(
        [sys.executable, "scripts/seeds.py", "--seeds=3", "--reuse", f"--out={tmp_path}",
         "--curve=critic/score/mean", "--curve_every=2", "--curve=val",
         *("configs/" + (a.replace("@", ".py@", 1) if "@" in a else a + ".py") for a in arms)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HFJAX_SMOKE": ""})
    assert out.returncode == 0, out.stderr
    mean, lo, hi = over_seeds(arms["ppo_arith"])
    assert f"after {mean:.3f} [{lo:.3f}, {hi:.3f}]" in out.stdout
    lines = out.stdout.splitlines()
    verdict = {line.split(":")[0]: (line, after) for line, after in zip(lines, lines[1:])
               if " vs " in line}
    assert "overlap: the two are within" in verdict["ppo_arith vs grpo_arith"][0]
    assert "do not overlap" in verdict["ppo_arith vs remax_arith"][0]
    assert "seed 2: before 0.100, after 0.610" in out.stdout
    # Paired by seed: grpo_arith beats its lr=1e-3 arm by 0.010 on every seed, which the
    # unpaired intervals cannot tell apart; the paired difference's interval is [0.010, 0.010].
    lr_pair = verdict["grpo_arith vs grpo_arith@actor.lr=1e-3"]
    assert "overlap: the two are within" in lr_pair[0]
    assert "difference +0.010 [+0.010, +0.010], excludes 0: told apart" in lr_pair[1]
    diffs = np.subtract(arms["ppo_arith"], arms["grpo_arith"])
    dm, dlo, dhi = over_seeds(list(diffs))
    assert (f"difference {dm:+.3f} [{dlo:+.3f}, {dhi:+.3f}], includes 0: not told apart"
            in verdict["ppo_arith vs grpo_arith"][1])
    # The curve: mean over seeds 0, 1, 2 of step + seed, at the first step, every 2nd and the
    # last.
    assert "  remax_arith: 1: 2.000, 2: 3.000, 4: 5.000" in lines
    assert "  remax_arith: 0: 0.500" in lines
    bad = subprocess.run([sys.executable, "scripts/seeds.py", "configs/nope.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no such config file: configs/nope.py" in bad.stderr
    bad = subprocess.run([sys.executable, "scripts/seeds.py", "configs/grpo_arith.py@actor.lr"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "override 'actor.lr' is not KEY=VALUE" in bad.stderr
