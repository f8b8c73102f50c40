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
    # Finished runs (result.json, as the script writes them) of three arms over 3 seeds.
    arms = {"ppo_arith": [0.95, 0.96, 0.94], "grpo_arith": [0.955, 0.945, 0.96],
            "remax_arith": [0.60, 0.62, 0.61]}
    for arm, afters in arms.items():
        for seed, after in enumerate(afters):
            os.makedirs(tmp_path / f"{arm}_s{seed}")
            with open(tmp_path / f"{arm}_s{seed}" / "result.json", "w") as f:
                json.dump(_result(after), f)
    out = subprocess.run(
        [sys.executable, "scripts/seeds.py", "--seeds=3", "--reuse", f"--out={tmp_path}",
         *(f"configs/{a}.py" for a in arms)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HFJAX_SMOKE": ""})
    assert out.returncode == 0, out.stderr
    mean, lo, hi = over_seeds(arms["ppo_arith"])
    assert f"after {mean:.3f} [{lo:.3f}, {hi:.3f}]" in out.stdout
    lines = out.stdout.splitlines()
    verdict = {line.split(":")[0]: line for line in lines if " vs " in line}
    assert "overlap: the two are within" in verdict["ppo_arith vs grpo_arith"]
    assert "do not overlap" in verdict["ppo_arith vs remax_arith"]
    assert "seed 2: before 0.100, after 0.610" in out.stdout
    bad = subprocess.run([sys.executable, "scripts/seeds.py", "configs/nope.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no such config file: configs/nope.py" in bad.stderr
