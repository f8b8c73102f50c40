"""Asynchronous rollout across processes (docs/async.md, "Across processes"): with
`launch.local_cluster --num_processes=2 --devices_per_process=4` and the placement
``gen=4:rollout;train=4:actor+ref+reward``, the rollout pool is process 0's devices and the
trainer's pool process 1's; batches come home and weights are pushed by collectives
(hfjax.parallel.cross_pool), and both processes run one schedule on one thread. Three GRPO steps
at K = 1 equal the one-process run on 8 devices (its rollout thread) within 1e-6, and each
pool's idle time, measured on its own process, reaches the metrics both log.

The job starts from scratch with tests/partial_credit_reward.py's per-character credit, so every
stage computes on non-zero numbers. No KL in the reward: GRPO divides by each group's reward
spread, which for a group of equal scores would blow a 1e-10 KL difference (XLA sums a few
log-probs in another order in the two layouts, ~1 float32 ulp) up to 1e-5.
"""

import math
import os
import subprocess
import sys

import partial_credit_reward
import pytest
from support import subprocess_env

from hfjax.run.metrics import is_timing_key, read_jsonl

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 3
OVERRIDES = {
    "algorithm": "grpo", "algo.adv_estimator": "grpo", "algo.use_kl_in_reward": False,
    "sft.steps": 0,
    "model.hidden_size": 32, "model.intermediate_size": 64, "model.head_dim": 16,
    "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1,
    "data.n_train": 64, "data.n_test": 16, "data.train_batch_size": 8, "rollout.n": 2,
    "rollout.response_length": 24,
    "actor.ppo_mini_batch_size": 8, "actor.ppo_micro_batch_size": 16,
    "reward.num_processes": 0,
    "reward.custom_fn": f"{partial_credit_reward.__file__}:{partial_credit_reward.score.__name__}",
    "placement": "gen=4:rollout;train=4:actor+ref+reward",
    "async_rollout.max_staleness": 1,
    "trainer.total_steps": TOTAL, "trainer.test_freq": TOTAL, "trainer.save_freq": 0,
    "trainer.logger": "jsonl", "trainer.plot": False,
}


def _args(out_dir) -> list[str]:
    return [f"--config.trainer.out_dir={out_dir}",
            *(f"--config.{k}={v}" for k, v in OVERRIDES.items())]


def _records(out_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_timing_key(k) and k != "async/push_s"}
            for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl"))]


def test_two_processes_one_pool_each_equal_one_process(tmp_path):
    env = subprocess_env(tmp_path / "xla_cache")
    two = tmp_path / "two"
    p = subprocess.run([sys.executable, "-m", "launch.local_cluster", "--num_processes=2",
                        "--devices_per_process=4", "--", *_args(two)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    one = tmp_path / "one"
    p = subprocess.run([sys.executable, "-m", "launch.train", "--cpu_devices=8", *_args(one)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    a, b = _records(one), _records(two)
    assert [r["step"] for r in b] == list(range(TOTAL + 1))
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    # The job trains, and its samples are as stale as the bound lets them be.
    assert all(r["actor/grad_norm"] > 0 and r["critic/score/mean"] > 0 for r in b[1:])
    assert [r["async/staleness/max"] for r in b[1:]] == [0.0, 1.0, 1.0]
    assert all(r["async/push_bytes"] > 0 for r in b[1:])
    for x, y in zip(a, b, strict=True):
        for k in x:
            assert abs(x[k] - y[k]) <= 1e-6 * max(1.0, abs(x[k])), (x["step"], k, x[k], y[k])
    # Each pool's idle time is measured on its own process (process 0 generates, process 1
    # trains) and every process logs both: process 0's file holds the trainer's wait too.
    steps = [r for r in read_jsonl(os.path.join(two, "metrics.jsonl"))
             if "timing_s/idle/train" in r]
    assert len(steps) == TOTAL
    for r in steps:
        for key in ("timing_s/idle/train", "timing_s/idle/rollout"):
            assert math.isfinite(r[key]) and r[key] >= 0, (r["step"], key, r[key])
