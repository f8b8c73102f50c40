"""Checkpoints across processes with a pool on each (docs/scaling.md, "Checkpoints across
processes"): the default config (PPO with a critic, KL in the reward, synchronous), the rollout
on process 0's device and the trainer's models on process 1's (`gen=1:rollout;train=1:...`),
so that every checkpointed array sits on one process only (hfjax.run.ckpt_shards).

The job saves every step, is SIGKILLed (both processes, a random moment after its first RL
checkpoint is complete), and the same command resumes it to the end. Its metrics and the
fingerprints of every array of its last checkpoint equal an uninterrupted run's bit for bit
(wall-clock keys aside): the same programs on the same processes.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from support import comparable_records, start_rank, subprocess_env, tiny_process_job

from launch import local_cluster

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 2
OVERRIDES = tiny_process_job(TOTAL) | {
    "placement": "gen=1:rollout;train=1:actor+ref+critic+reward"}


def _args(out_dir) -> list[str]:
    return [f"--config.trainer.out_dir={out_dir}",
            *(f"--config.{k}={v}" for k, v in OVERRIDES.items())]


def _arrays(out_dir, step=TOTAL) -> dict:
    """{item: {leaf: shape, dtype, fingerprint}} that a checkpoint's trainer state records."""
    with open(os.path.join(out_dir, "checkpoints", str(step), "trainer", "metadata")) as f:
        return json.load(f)["arrays"]


def test_pool_per_process_killed_then_resumed_bitwise(tmp_path):
    # A cache of its own: processes are killed here, maybe while writing to it.
    env = subprocess_env(tmp_path / "xla_cache")
    ref = tmp_path / "ref"
    p = subprocess.run([sys.executable, "-m", "launch.local_cluster", "--num_processes=2",
                        "--devices_per_process=1", "--", *_args(ref)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # The trainer's arrays sit on process 1 alone: each process saved what it holds.
    items = os.listdir(ref / "checkpoints" / str(TOTAL))
    assert "actor_params.per_process" in items and "critic_params.per_process" in items, items
    run = tmp_path / "run"
    with open(tmp_path / "log", "a") as log:
        port = local_cluster.free_port()
        procs = [start_rank(rank, port, _args(run), env, log) for rank in range(2)]
        done = run / "checkpoints" / "1" / "trainer"
        deadline = time.monotonic() + 600
        while not done.is_dir() and time.monotonic() < deadline:
            assert all(q.poll() is None for q in procs), open(tmp_path / "log").read()[-3000:]
            time.sleep(0.05)
        time.sleep(random.uniform(0, 0.3))
        for q in procs:
            q.send_signal(signal.SIGKILL)
        codes = [q.wait(timeout=60) for q in procs]
        assert codes == [-signal.SIGKILL] * 2, (codes, open(tmp_path / "log").read()[-3000:])
        port = local_cluster.free_port()
        procs = [start_rank(rank, port, _args(run), env, log) for rank in range(2)]
        codes = [q.wait(timeout=600) for q in procs]
    text = open(tmp_path / "log").read()
    assert codes == [0, 0], text[-3000:]
    assert "resuming from" in text
    metrics = comparable_records(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(TOTAL + 1))
    assert metrics == comparable_records(ref / "metrics.jsonl")
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in metrics[1:])
    assert _arrays(run) == _arrays(ref)
    assert _arrays(ref) != _arrays(ref, step=0)  # the job moved its parameters
