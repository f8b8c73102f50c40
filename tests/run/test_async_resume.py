"""Asynchronous rollout, killed and rerun (docs/async.md, "Checkpoints"): `python -m
launch.train` with max_staleness K = 2 on a split placement (2 CPU devices) checkpoints every
step; it is SIGKILLed at a random moment after a checkpoint of step 2 to 4 is complete and the
same command is run again. It resumes from checkpoint 2 or later, where batches issued ahead
are queued. A checkpoint holds the async state: the data cursor before the batches issued ahead
of the trainer, the schedule's origin, and the older weights those batches were made with
(K = 2: the two versions before the current one). The rerun remakes those batches exactly, so its
metrics JSONL equals an uninterrupted run's bit for bit, wall-clock keys aside: every prompt
is trained once, at the same step, with samples of the same staleness.

The job is tiny and starts from scratch, with tests/partial_credit_reward.py's per-character
credit so that every stage computes on non-zero numbers.
"""

import os
import random
import signal
import subprocess
import time

import partial_credit_reward
import pytest
from support import comparable_records, run_train, subprocess_env, train_cmd

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 6
OVERRIDES = {
    "algorithm": "grpo", "algo.adv_estimator": "grpo", "sft.steps": 0,
    "model.hidden_size": 32, "model.intermediate_size": 64, "model.head_dim": 16,
    "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1,
    "data.n_train": 64, "data.n_test": 16, "data.train_batch_size": 4, "rollout.n": 2,
    "rollout.response_length": 8,
    "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size": 8,
    "reward.num_processes": 0,
    "reward.custom_fn": f"{partial_credit_reward.__file__}:{partial_credit_reward.score.__name__}",
    "placement": "split", "async_rollout.max_staleness": 2,
    "trainer.total_steps": TOTAL, "trainer.test_freq": 3, "trainer.save_freq": 1,
    "trainer.max_to_keep": 2, "trainer.logger": "jsonl", "trainer.plot": False,
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # A cache of its own: runs are killed here, maybe while writing to it.
    return subprocess_env(tmp_path_factory.mktemp("xla_cache"))


def test_sigkill_then_rerun_trains_every_prompt_once_exactly(tmp_path, env):
    ref_dir = tmp_path / "reference"
    assert run_train(ref_dir, env, OVERRIDES, cpu_devices=2)["resumed_from"] is None
    ref = comparable_records(ref_dir / "metrics.jsonl")
    assert [r["step"] for r in ref] == list(range(TOTAL + 1))
    # The job trains, on samples as stale as the bound lets them be.
    assert sum(r["actor/grad_norm"] > 0 for r in ref[1:]) >= 3
    assert [r["async/staleness/max"] for r in ref[1:]] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]

    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    kill_after, delay = rng.randint(2, 4), rng.uniform(0.0, 0.3)
    out = tmp_path / "run"
    log = open(tmp_path / "run.log", "w")
    p = subprocess.Popen(train_cmd(out, OVERRIDES, cpu_devices=2), cwd=ROOT, env=env,
                         stdout=log, stderr=subprocess.STDOUT)
    log.close()
    path = out / "metrics.jsonl"
    # Once checkpoint `kill_after` is complete (its batches issued ahead are in it), a random
    # moment later: mid-step, mid-generation or mid-save.
    done = out / "checkpoints" / str(kill_after) / "trainer"
    deadline = time.monotonic() + 600
    while p.poll() is None and time.monotonic() < deadline:
        if done.is_dir():
            time.sleep(delay)
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, f"job ended before the kill (seed {seed})"
    summary = run_train(out, env, OVERRIDES, cpu_devices=2)
    start = summary["resumed_from"]
    assert start is not None and kill_after <= start < TOTAL, (seed, summary)
    assert summary["step"] == TOTAL
    resumed = comparable_records(path)
    after = [r for r in resumed if r["step"] > start]
    assert after == [r for r in ref if r["step"] > start], f"seed {seed}, resumed at {start}"
    assert resumed == ref, f"seed {seed}"
