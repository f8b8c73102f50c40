"""bench.accelerator --tiny as a real process on CPU: the project's GRPO steps measured, one
JSON line with every figure, and --config overrides passed through to the run."""

import json
import math
import os
import subprocess
import sys

import pytest
from support import subprocess_env

# The checkout itself (realpath: under Bazel this file is a link in the runfiles, which hold
# no bench/).
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
POSITIVE = ("decode_ms_per_step", "decode_bound_ms", "matmul_peak_flops", "rollout_tokens_per_s",
            "update_mfu", "ref_mfu", "dry_run_peak_bytes", "step_s", "gen_s", "update_actor_s")


@pytest.mark.slow  # a real process that compiles a GRPO step: about 40 s on 2 cores
def test_tiny_accelerator_bench_reports_every_figure():
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.accelerator", "--tiny", "--steps=1",
         "--config.model.remat_policy=full"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in POSITIVE:
        assert isinstance(out[key], (int, float)) and math.isfinite(out[key]) and out[key] > 0, key
    # MFU is a fraction of a peak measured in the same run; the bound is under the real step.
    assert out["update_mfu"] < 1 and out["ref_mfu"] < 1
    assert out["decode_bound_ms"] < out["decode_ms_per_step"]
    assert out["mfu_peak"] == "measured_matmul"  # no table peak for a CPU
    # No CUDA torch, no device memory stats on CPU.
    assert out["hf_generate_ratio"] is None and out["measured_peak_bytes"] is None
    assert out["device_kind"] == "cpu" and out["jax_version"]
    cfg = out["config"]
    assert cfg["model"] == "preset:tiny" and cfg["remat_policy"] == "full"
    assert cfg["overrides"] == ["--config.model.remat_policy=full"]
    assert cfg["measured_steps"] == 1
